"""The report of many runs, rendered (docs/design.md §8): the records posbench/report/records.py collects and what
posbench/report/compare.py computes from them, as files.

``posbench report FOLDER...`` (and the end of every multirun) writes into a folder ``report.md`` (a table per
evaluation setting, rows labelled short with a legend table of the settings that differ, ★ against each column's
reference with the tests named and a footnote where a printed number does not tell its verdict; the probes' tables;
the settings held fixed; fine-tuned runs whose parent is not reported; skipped runs, each with the reason),
``report.csv`` (the same numbers and tests, long format, with the full ``setting`` beside each short ``label``),
``passkey.csv`` and ``context.csv`` with the probes, and the plots of posbench/report/plots.py (:func:`_draw`).

    posbench report multirun/2026-11-21/10-00-00 [--out DIR]
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

from posbench.evaluation import context, retrieval, stats
from posbench.evaluation.results import split_text
from posbench.report import compare, plots
from posbench.report.probe_tables import CONTEXT_COLUMNS, PASSKEY_COLUMNS, context_tables, passkey_tables, probe_title
from posbench.report.records import collect, origin_length, orphans
from posbench.report.settings import legend, settings, value_key

log = logging.getLogger("posbench")
REPORT_COLUMNS = ["table", "setting", "protocol", "stride", "split", "scored_split", "max_tokens", "lengths", "length",
                  "ppl", "ppl_std", "nll_mean", "nll_std", "seeds", "best", "test", "p_value", "ci_low", "ci_high",
                  "significantly_worse", "method", "train_tokens", "total_train_tokens", "label", "reference", "windows"]
SUPERSCRIPT = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")


def table_title(r: dict) -> str:
    """A table's evaluation settings in words, e.g. ``nonoverlapping, validation split, max_tokens=16384, lengths 128…2048``."""
    lengths = r["lengths"]
    doubling = len(lengths) > 2 and all(b == 2 * a for a, b in zip(lengths, lengths[1:]))
    return ", ".join([r["protocol"] + (f" (stride {r['stride']})" if r["protocol"] == "sliding" else ""), split_text(r),
                      "max_tokens=all (whole split)" if r["max_tokens"] is None else f"max_tokens={r['max_tokens']}",
                      (f"lengths {lengths[0]}…{lengths[-1]}" if doubling else
                       f"length{'s' * (len(lengths) > 1)} {', '.join(map(str, lengths))}")])


def _mark(r: dict) -> str:
    if r["test"] == "n/a":
        return " †"
    return "" if r["significantly_worse"] else " ★"


def puzzles(column: list[dict]) -> list[dict]:
    """The cells of one column (:func:`posbench.evaluation.stats.rank`-ed) whose verdicts their printed numbers do not tell: each
    significantly worse cell that prints no higher than the reference or a tested ★ cell (equal numbers, or an order
    the stars reverse), and those tested ★ cells; in row order."""
    def shown(c):
        return round(c["ppl"], 2)

    stars = [c for c in column if c["test"] != "n/a" and not c["significantly_worse"]]  # the reference among them
    odd = {id(x) for w in column if w["significantly_worse"] for s in stars if shown(s) >= shown(w)
           for x in (w, s) if not x["best"]}
    return [c for c in column if id(c) in odd]


def _footnote(mark: str, number: str | None) -> str:
    return "" if number is None else number if mark else f" {number}"


def _footnotes(sub: list[dict]) -> tuple[dict[tuple[str, int], str], list[str]]:
    """{(setting, length): superscript number} of one table's :func:`puzzles`, and their footnotes: each cell's
    verdict against its column's reference, with the test and its statistic (posbench/evaluation/stats.py ``reason``)."""
    odd = {id(c) for n in sorted({r["length"] for r in sub}) for c in puzzles([r for r in sub if r["length"] == n])}
    marks, lines = {}, []
    for c in (r for r in sub if id(r) in odd):
        ref = next(r for r in sub if r["length"] == c["length"] and r["best"])
        marks[c["setting"], c["length"]] = str(len(marks) + 1).translate(SUPERSCRIPT)
        verdict = "no ★: significantly worse" if c["significantly_worse"] else "★: not significantly worse"
        lines.append(f"- {marks[c['setting'], c['length']]} {c['label']} at {c['length']} ({c['ppl']:.2f}), {verdict} "
                     f"than the reference {ref['label']} ({ref['ppl']:.2f}); {stats.reason(c)}.")
    return marks, lines


def tables(rows: list[dict], train_length: int) -> str:
    """Markdown tables, one per evaluation setting (its title states them): short row labels × lengths, cells
    exp(mean NLL) ± std of per-seed perplexity with ★/† marks and footnote numbers (:func:`puzzles`),
    ppl(longest)/ppl(L) per row, seeds; then the rows' :func:`legend`, a note naming each column's reference and the
    tests, and the footnotes."""
    out = []
    for table in sorted({r["table"] for r in rows}):
        sub = [r for r in rows if r["table"] == table]
        lengths = sub[0]["lengths"]
        base = train_length if train_length in lengths else lengths[0]
        ratio, tokens = len(lengths) > 1, any(r.get("method") for r in sub)  # tokens: fine-tuned rows, their budget
        lines = [f"### {table}. {table_title(sub[0])}", "",
                 "| | " + " | ".join(map(str, lengths)) + (f" | ppl({lengths[-1]})/ppl({base})" if ratio else "")
                 + (" | train tokens (own / total)" if tokens else "") + " | seeds |",
                 "|---" * (len(lengths) + 2 + ratio + tokens) + "|"]
        settings_ = list(dict.fromkeys(r["setting"] for r in sub))
        compared = len(settings_) > 1  # one row: nothing to compare, no marks
        marks, footnotes = _footnotes(sub) if compared else ({}, [])
        for setting in settings_:
            mine = {r["length"]: r for r in sub if r["setting"] == setting}
            cells = [f"{mine[n]['ppl']:.2f}" + (f" ± {mine[n]['ppl_std']:.2f}" if mine[n]["seeds"] > 1 else "")
                     + (_mark(mine[n]) + _footnote(_mark(mine[n]), marks.get((setting, n))) if compared else "")
                     for n in lengths]
            cells += [f"{mine[lengths[-1]]['ppl'] / mine[base]['ppl']:.2f}"] if ratio else []
            cells += [_tokens(mine[lengths[0]])] if tokens else []
            lines.append(f"| {mine[lengths[0]]['label']} | " + " | ".join(cells) + f" | {mine[lengths[0]]['seeds']} |")
        out.append("\n".join([*lines, *legend(sub), *(["", stats.note(sub), *([""] + footnotes if footnotes else [])]
                                                      if compared else [])]))
    return "\n\n".join(out)


def _tokens(r: dict) -> str:
    """``409,600 / 1,843,200``: a row's own train tokens and, for a fine-tuned run, the total with its parent's line."""
    def show(n):
        return "–" if n is None else f"{n:,}"
    return show(r.get("train_tokens")) + (f" / {show(r['total_train_tokens'])}" if r.get("total_train_tokens") else "")


def _write_csv(path: Path, columns: list[str], rows) -> None:
    """``rows`` (dicts) as CSV at ``path``: ``columns`` in order, other keys left out."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _draw(out: Path, records: list[dict], rows: list[dict], context_cells: list[dict]) -> dict[str, Path]:
    """Every plot of the report into ``out`` (posbench/report/plots.py); return {name: path}."""
    labels = compare.labels(records)
    numbers = sorted({r["table"] for r in rows})
    panels = [(f"{n}. {table_title(next(r for r in rows if r['table'] == n))}", [r for r in rows if r["table"] == n],
               compare.position_curves(records, rows, n)) for n in numbers]
    images = plots.draw(out, panels, labels)
    probes = retrieval.groups(records)
    if probes:
        first = next(iter(probes.values()))
        title = "P1. " + probe_title(next(iter(first.values()))["settings"])
        images.update(plots.draw_passkey(out, retrieval.by_distance(records), retrieval.by_depth(records), labels, title))
    curves = retrieval.probe_curves(records)
    if curves:
        images["passkey_vs_tokens"] = plots.draw_probe_curves(out, curves, labels,
                                                              retrieval.probe_curves(records, "transfer"))
    if context_cells:
        images["context_vs_length"] = plots.draw_context(out, context.series(context_cells),
                                                         context_cells[0]["settings"]["train_length"], labels)
    series = compare.finetune_series(rows)
    if series:
        images["ppl_vs_finetune"] = plots.draw_finetune(out, series, compare.finetune_parents(rows),
                                                        max(rows[0]["lengths"]), panels[0][0])
    return images


def write_report(folders: list[Path], out: Path) -> tuple[str, list[dict], dict[str, Path]]:
    """Collect, fold, write report.md / report.csv / passkey.csv / context.csv and the PNGs into ``out``; return
    (tables, rows, images).

    Raises posbench.report.records.ReportError when there is nothing to report."""
    records, skipped = collect(folders)
    for line in [*(f"skipped {line}" for line in skipped), *orphans(records)]:
        log.warning("%s", line)
    rows = compare.fold(records)
    train_length = origin_length(records[0])  # (collect keeps one L; a fine-tune's is its line's first)
    out.mkdir(parents=True, exist_ok=True)
    names = {r["setting"]: r for r in rows}
    _write_csv(out / "report.csv", REPORT_COLUMNS, ({**r, "lengths": " ".join(map(str, r["lengths"]))} for r in rows))
    probe_cells, context_cells = retrieval.cells(records), context.cells(records)
    if probe_cells:
        _write_csv(out / "passkey.csv", PASSKEY_COLUMNS, ({**c, "label": names[c["setting"]]["label"]} for c in probe_cells))
    if context_cells:
        _write_csv(out / "context.csv", CONTEXT_COLUMNS, ({**c, "label": names[c["setting"]]["label"]} for c in context_cells))
    images = _draw(out, records, rows, context_cells)
    (out / "report.md").write_text(render_markdown(records, rows, skipped, set(images), probe_cells, context_cells))
    return tables(rows, train_length), rows, images


def _grouped(per_scheme: dict[str, dict]) -> dict[str, list[str]]:
    """{scheme settings as JSON: the labels that have them}, in first-seen order: one line per distinct set."""
    groups = {}
    for name, vals in per_scheme.items():
        groups.setdefault(json.dumps(vals), []).append(name)
    return groups


def render_markdown(records: list[dict], rows: list[dict], skipped: list[str], images: set[str], probe_cells: list[dict],
                    context_cells: list[dict]) -> str:
    """report.md's text, from what :func:`write_report` gathered (the records, their folded ``rows``, the ``skipped``
    lines, the names of the images drawn, the probes' cells); it reads and writes nothing."""
    train_length = origin_length(records[0])
    _, fixed, varying, per_scheme = settings(records)
    names = {r["setting"]: r for r in rows}
    seeds = sorted({r["seed"] for r in records}, key=value_key)
    sections = [("Settings held fixed", [f"`{k}` = {v}" for k, v in fixed.items()]),
                ("Scheme settings", [", ".join(names) + ": " + ", ".join(f"`{k}` = {v}" for k, v in json.loads(vals).items())
                                     for vals, names in _grouped(per_scheme).items()]),
                ("Settings that differ but do not split rows (bookkeeping; evaluation settings are in the table titles)",
                 [f"`{k}`: {', '.join(v)}" for k, v in varying.items()]),
                ("Fine-tuned runs whose parent is not reported", orphans(records)), ("Skipped", skipped)]
    return (f"# posbench report: perplexity by evaluation length (L = {train_length})\n\n"
            + ("Fine-tuned runs (started from a parent's weights, `init_from`) are labelled `ft<length>×<steps>`; L is "
               "that of the first run of their line (the parent's), and their budget is in the tokens column.\n\n"
               if "ppl_vs_finetune" in images else "")
            + f"{len(records)} results from runs with seeds {seeds}. One table per evaluation setting; a row per scheme "
            "and per value of every other setting that differs between runs, labelled by its run label and, where rows "
            "share one, the values that tell them apart; the settings that differ "
            "between runs are in a table below each table. Each cell is the "
            "perplexity exp(mean NLL over seeds), NLL in nats/token, ± the standard deviation over seeds of the "
            "per-seed perplexity; ★ marks, in each column, the reference (the lowest mean NLL) and the cells not "
            "significantly worse than it (the references and tests are named under each table; a numbered cell's "
            "test is written out below it).\n\n"
            f"{tables(rows, train_length)}\n\n![ppl vs length, a panel per table](ppl_vs_length.png)\n"
            "![loss vs position, a panel per table](loss_vs_position.png)\n"
            + ("![ppl vs fine-tuning tokens](ppl_vs_finetune.png)\n" if "ppl_vs_finetune" in images else "")
            + (f"\n## Passkey retrieval (eval.probes=[passkey])\n\n{passkey_tables(probe_cells, names)}\n\n"
               "![passkey accuracy vs distance (table P1)](passkey_vs_distance.png)\n"
               "![passkey depth x length (table P1)](passkey_heatmap.png)\n" if probe_cells else "")
            + ("\n![passkey accuracy vs training tokens](passkey_vs_tokens.png)\n" if "passkey_vs_tokens" in images else "")
            + (f"\n## Context use past L (eval.probes=[context])\n\n{context_tables(context_cells, names)}\n\n"
               "![context use vs length](context_vs_length.png)\n" if context_cells else "")
            + "".join(f"\n## {head}\n\n" + "\n".join(f"- {line}" for line in lines) + "\n" for head, lines in sections
                      if lines or head == "Settings held fixed"))
