"""``posbench report``: many runs' records collected, the newest of each setting, each fine-tune beside its parent
(records), how their settings differ and the rows they make (settings), their numbers folded into cells and the
plots' series (compare), the probes' tables (probe_tables), the report rendered as files (render) and its plots
drawn from data handed to them (plots),
what they write on their axes (axes: ticks, labels at the lines' ends).
The significance tests and the probes' cells it uses live in posbench/evaluation/ (stats, retrieval, context).

    from posbench.report import render
    text, rows, images = render.write_report([Path("multirun/2026-11-21/10-00-00")], out=Path("rep"))

It reads records (results.json, eval-*.json) and never a model: nothing here runs a forward pass. Imports the
evaluation and config wings (records of older formats: posbench/config/upgrade.py). Start with render.py.
"""
