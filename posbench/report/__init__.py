"""The report tier: many runs' records collected and compared (compare), their differences tested (stats), the
passkey probe's trials across runs (retrieval), and the report rendered as files (render, plots).

    from posbench.report import render
    text, rows, images = render.write_report([Path("multirun/2026-11-21/10-00-00")], out=Path("rep"))

It reads records (results.json, eval-*.json) and never a model: nothing here runs a forward pass. Records of older
formats are read through posbench/upgrade.py, which needs the schemes' typed configs. This file imports nothing, so
importing one module of the tier loads that module alone.
"""
