"""The report of many runs, rendered (docs/design.md §8): what posbench/compare.py computes, as files.

``posbench report FOLDER...`` (and the end of every multirun) writes into a folder:

* ``report.md`` — one table per evaluation setting (protocol, stride, split, token budget, lengths); rows =
  scheme and every other setting that differs between runs, columns = evaluation lengths, cells =
  exp(mean NLL over seeds) ± std over seeds of the per-seed perplexity, ★ where a cell is the best or not
  significantly worse (posbench/stats.py), and ppl(longest)/ppl(L); the settings held fixed; skipped runs;
* ``report.csv`` — the same numbers and tests, long format;
* ``ppl_vs_length.png`` and ``loss_vs_position.png`` (posbench/plots.py), of one evaluation setting (validation
  split and the nonoverlapping protocol when present), and ``ppl_vs_finetune.png`` when fine-tuned runs
  (``init_from``: ``ft512×200`` rows, with a column of train tokens) are among them;
* with passkey probes (``eval.probes=[passkey]``): a retrieval table in ``report.md`` (posbench/retrieval.py),
  ``passkey.csv``, ``passkey_vs_distance.png`` and ``passkey_heatmap.png``;
* with the context-use probe (``eval.probes=[context]``): a "Context use past L" table (posbench/context.py),
  ``context.csv`` and ``context_vs_length.png``.

    posbench report multirun/2026-11-21/10-00-00 [--out DIR]
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

from posbench import compare, context, plots, retrieval, stats
from posbench.results import split_text

log = logging.getLogger("posbench")
REPORT_COLUMNS = ["table", "setting", "protocol", "stride", "split", "scored_split", "max_tokens", "lengths", "length",
                  "ppl", "ppl_std", "nll_mean", "nll_std", "seeds", "best", "test", "p_value", "ci_low", "ci_high",
                  "significantly_worse", "method", "train_tokens", "total_train_tokens"]


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


def tables(rows: list[dict], train_length: int) -> str:
    """Markdown tables, one per evaluation setting (its title states them): settings × lengths, cells
    exp(mean NLL) ± std of per-seed perplexity with ★/† marks, ppl(longest)/ppl(L) per row, seeds; a note on the tests."""
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
        for setting in settings_:
            mine = {r["length"]: r for r in sub if r["setting"] == setting}
            cells = [f"{mine[n]['ppl']:.2f}" + (f" ± {mine[n]['ppl_std']:.2f}" if mine[n]["seeds"] > 1 else "")
                     + (_mark(mine[n]) if compared else "") for n in lengths]
            cells += [f"{mine[lengths[-1]]['ppl'] / mine[base]['ppl']:.2f}"] if ratio else []
            cells += [_tokens(mine[lengths[0]])] if tokens else []
            lines.append(f"| {setting} | " + " | ".join(cells) + f" | {mine[lengths[0]]['seeds']} |")
        out.append("\n".join([*lines, *(["", stats.note(sub)] if compared else [])]))
    return "\n\n".join(out)


def _tokens(r: dict) -> str:
    """``409,600 / 1,843,200``: a row's own train tokens and, for a fine-tuned run, the total with its parent's line."""
    def show(n):
        return "–" if n is None else f"{n:,}"
    return show(r.get("train_tokens")) + (f" / {show(r['total_train_tokens'])}" if r.get("total_train_tokens") else "")


PASSKEY_COLUMNS = ["table", "setting", "length", "n", "correct", "accuracy", "ci_low", "ci_high", "gain", "within_L", "valid",
                   "ranked", "best", "p_value", "star"]


def passkey_tables(cells: list[dict]) -> str:
    """The passkey probe's tables (posbench/retrieval.py), one per probe: rows × probe lengths, cells exact-match
    accuracy with its Wilson 95% interval and ★ (the column's best ranked row, or not significantly worse by the
    paired test) or † (untested), the accuracy within L and the mean gain at the longest length; a row below the
    threshold within L is marked and not ranked past L."""
    out = []
    for table in sorted({c["table"] for c in cells}):
        sub = [c for c in cells if c["table"] == table]
        probe, lengths = sub[0]["settings"], sorted({c["length"] for c in sub})
        keys = probe.get("keys", "frequent")
        share = f" ({probe['key_fraction']:.2%} of the split's tokens are key tokens)" if "key_fraction" in probe else ""
        lines = [f"### P{table}. {probe.get('split', 'validation')} split, key of {probe['key_length']} tokens from "
                 f"{probe['key_vocab']} {retrieval.KEY_KINDS.get(keys, keys)}{share}, marker {probe['marker']!r}, "
                 f"probe seed {probe['seed']}", "",
                 "| | " + " | ".join(map(str, lengths)) + f" | within L | gain at {lengths[-1]} |",
                 "|---" * (len(lengths) + 3) + "|"]
        for setting in dict.fromkeys(c["setting"] for c in sub):
            mine = {c["length"]: c for c in sub if c["setting"] == setting}
            first = next(iter(mine.values()))
            row = [f"{mine[n]['accuracy']:.0%} ({mine[n]['ci_low']:.0%}–{mine[n]['ci_high']:.0%})" + _probe_mark(mine[n])
                   if n in mine else "" for n in lengths]
            within = "–" if first["within_L"] is None else f"{first['within_L']:.0%}"
            label = setting + ("" if first["valid"] else " (does not retrieve within L)" if first["within_L"] is not None
                               else " (no probe length ≤ L: not ranked past L)")
            gain = f"{mine[lengths[-1]]['gain']:+.2f}" if lengths[-1] in mine else ""
            lines.append(f"| {label} | " + " | ".join(row) + f" | {within} | {gain} |")
        n = max(c["n"] for c in sub)
        lines += ["", f"Exact match of the key, % of up to {n} trials per cell ({probe['trials']} per depth × "
                  f"{len(probe['depths'])} depths {list(probe['depths'])} per seed, the same windows for every row), with "
                  "the Wilson 95% interval (Wilson 1927; seeds pooled as trials). ★: the best ranked row of the column, or "
                  "not significantly worse than it by a paired sign test over the windows both were probed on (each "
                  "window's accuracy over the row's seeds; with one seed the exact McNemar test, McNemar 1947; two-sided "
                  f"p ≥ {stats.ALPHA}); †: no shared window, untested; no ★ where no ranked row retrieved a key. Within L: "
                  f"accuracy in the windows no longer than L; below {probe['threshold']:.0%} the row does not retrieve "
                  "within L and is not ranked past L. Gain: the key's mean log-probability (nats/token) minus the same "
                  "key's when the needle held another key (0: the context is not used)."]
        out.append("\n".join(lines))
    return "\n\n".join(out)


CONTEXT_COLUMNS = ["table", "setting", "length", "windows", "seeds", "diff", "ci_low", "ci_high", "nll_full", "nll_short"]


def _nats(x: float) -> str:
    return f"{x:+.3f}".replace("-", "−")


def context_tables(cells: list[dict]) -> str:
    """The context-use probe's tables (posbench/context.py ``cells``), one per probe (split, L, stride): rows ×
    evaluation lengths, cells the mean NLL difference past L with its bootstrap 95% interval, nats/token."""
    out = []
    for table in sorted({c["table"] for c in cells}):
        sub = [c for c in cells if c["table"] == table]
        s, lengths = sub[0]["settings"], sorted({c["length"] for c in sub})
        L, S = s["train_length"], s["stride"]
        lines = [f"### C{table}. {s.get('split', 'validation')} split, L = {L}, stride {S}", "",
                 "| | " + " | ".join(map(str, lengths)) + " | seeds |", "|---" * (len(lengths) + 2) + "|"]
        for setting in dict.fromkeys(c["setting"] for c in sub):
            mine = {c["length"]: c for c in sub if c["setting"] == setting}
            row = [f"{_nats(mine[n]['diff'])} ({_nats(mine[n]['ci_low'])} … {_nats(mine[n]['ci_high'])})" if n in mine
                   else "" for n in lengths]
            lines.append(f"| {setting} | " + " | ".join(row) + f" | {max(c['seeds'] for c in mine.values())} |")
        windows = ", ".join(f"{n}: {max(c['windows'] for c in sub if c['length'] == n)}" for n in lengths)
        lines += ["", f"Mean over windows of NLL_full − NLL_short (nats/token) for the tokens at positions ≥ L of each "
                  f"window: NLL_full with the token's whole left context in the window, NLL_short by a sliding window of "
                  f"L tokens with stride {S} (each token keeps {L - S + 1}…{L} tokens of context). Negative: the model "
                  "uses context beyond L; 0: it ignores it; positive: the longer context hurts. In brackets the "
                  f"percentile bootstrap 95% interval over windows ({s['bootstrap']} resamples, seed {s['seed']}); "
                  f"seeds pooled per window (the mean over a row's seeds). Windows per length: {windows}."]
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _probe_mark(c: dict) -> str:
    """★ (best, or not significantly worse), † (ranked but untested: no window shared with the best), or nothing."""
    if c["star"]:
        return " ★"
    return " †" if c.get("untested") else ""


# ---- files ---------------------------------------------------------------------------------------


def _write_csv(path: Path, columns: list[str], rows) -> None:
    """``rows`` (dicts) as CSV at ``path``: ``columns`` in order, other keys left out."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def write_report(folders: list[Path], out: Path) -> tuple[str, list[dict], dict[str, Path]]:
    """Collect, fold, write report.md / report.csv / both PNGs into ``out``; return (tables, rows, images).

    Raises posbench.compare.ReportError when there is nothing to report."""
    records, skipped = compare.collect(folders)
    for line in skipped:
        log.warning("skipped %s", line)
    rows = compare.fold(records)
    train_length = compare.origin_length(records[0])  # (collect keeps one L; a fine-tune's is its line's first)
    _, fixed, varying, per_scheme = compare.settings(records)
    out.mkdir(parents=True, exist_ok=True)
    _write_csv(out / "report.csv", REPORT_COLUMNS, ({**r, "lengths": " ".join(map(str, r["lengths"]))} for r in rows))
    first = [r for r in rows if r["table"] == 1]  # the plotted table: validation split, nonoverlapping when present
    images = plots.draw(out, train_length, table_title(first[0]), first, compare.position_curves(records, rows),
                        compare.setting_order(records))
    probe_cells = retrieval.cells(records)
    if probe_cells:
        _write_csv(out / "passkey.csv", PASSKEY_COLUMNS, probe_cells)
        images.update(plots.draw_passkey(out, retrieval.by_distance(records), retrieval.by_depth(records),
                                         compare.setting_order(records)))
    curves = retrieval.probe_curves(records)
    if curves:
        images["passkey_vs_tokens"] = plots.draw_probe_curves(out, curves, compare.setting_order(records))
    context_cells = context.cells(records)
    if context_cells:
        _write_csv(out / "context.csv", CONTEXT_COLUMNS, context_cells)
        images["context_vs_length"] = plots.draw_context(out, context.series(context_cells),
                                                         context_cells[0]["settings"]["train_length"],
                                                         compare.setting_order(records))
    series = compare.finetune_series(rows)
    if series:
        images["ppl_vs_finetune"] = plots.draw_finetune(out, series, max(first[0]["lengths"]), table_title(first[0]))
    seeds = sorted({r["seed"] for r in records}, key=compare.value_key)
    table_text = tables(rows, train_length)
    sections = [("Settings held fixed", [f"`{k}` = {v}" for k, v in fixed.items()]),
                ("Scheme settings", [f"{name}: " + ", ".join(f"`{k}` = {v}" for k, v in vals.items()) for name, vals in per_scheme.items()]),
                ("Settings that differ but do not split rows (bookkeeping; evaluation settings are in the table titles)",
                 [f"`{k}`: {', '.join(v)}" for k, v in varying.items()]),
                ("Skipped", skipped)]
    text = (f"# posbench report: perplexity by evaluation length (L = {train_length})\n\n"
            + ("Fine-tuned runs (started from a parent's weights, `init_from`) are labelled `ft<length>×<steps>`; L is "
               "that of the first run of their line (the parent's), and their budget is in the tokens column.\n\n" if series else "")
            + f"{len(records)} results from runs with seeds {seeds}. One table per evaluation setting; a row per scheme "
            "and per value of every other setting that differs between runs. Each cell is the perplexity exp(mean NLL "
            "over seeds), NLL in nats/token, ± the standard deviation over seeds of the per-seed perplexity; ★ marks "
            "the best cell of a column and those not significantly worse (the test is named under each table).\n\n"
            f"{table_text}\n\n![ppl vs length](ppl_vs_length.png)\n![loss vs position](loss_vs_position.png)\n"
            + ("![ppl vs fine-tuning tokens](ppl_vs_finetune.png)\n" if series else "")
            + (f"\n## Passkey retrieval (eval.probes=[passkey])\n\n{passkey_tables(probe_cells)}\n\n"
               "![passkey accuracy vs distance](passkey_vs_distance.png)\n![passkey depth x length](passkey_heatmap.png)\n"
               if probe_cells else "")
            + ("\n![passkey accuracy vs training tokens](passkey_vs_tokens.png)\n" if curves else "")
            + (f"\n## Context use past L (eval.probes=[context])\n\n{context_tables(context_cells)}\n\n"
               "![context use vs length](context_vs_length.png)\n" if context_cells else "")
            + "".join(f"\n## {head}\n\n" + "\n".join(f"- {line}" for line in lines) + "\n" for head, lines in sections
                      if lines or head == "Settings held fixed"))
    (out / "report.md").write_text(text)
    return table_text, rows, images
