"""The numbers of a report and the series its plots draw (docs/design.md §8), from the records
posbench/report/records.py collects; posbench/report/render.py renders them.

* :func:`fold` — one row per (table, setting, evaluation length): exp(mean NLL over seeds) ± std over seeds, the
  best cell of each column and the significance test against it (posbench/evaluation/stats.py);
* :func:`ppl_series`, :func:`finetune_series`, :func:`finetune_parents`, :func:`position_curves` and :func:`labels`
  — what the report's plots and wandb draw.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from posbench.evaluation import stats
from posbench.evaluation.results import run_label
from posbench.report.records import origin_length
from posbench.report.settings import eval_settings, value_key

# ---- the numbers ---------------------------------------------------------------------------------


def _preference(group: tuple, n_records: int) -> tuple:
    """Tables (and the plots, of the first) in this order: validation split, nonoverlapping, most records,
    then the most tokens scored and the most lengths."""
    protocol, stride, split, scored, max_tokens, lengths = group
    return (split != "validation", protocol != "nonoverlapping", -n_records, max_tokens is not None, -(max_tokens or 0),
            -len(lengths), protocol, stride or 0, split, scored, lengths)


def fold(records: list[dict]) -> list[dict]:
    """Long-format rows, one per (table, setting, length): tables in :func:`_preference` order, settings in row order.
    Each row: ``table``, ``setting``, ``label`` and ``differs`` (its records' row), the evaluation settings, ``length``,
    its run's training (:func:`_budget`: ``train_length``, ``origin_length``, ``method``, tokens), and
    :func:`posbench.evaluation.stats.summary` and :func:`posbench.evaluation.stats.rank` of its seeds: ``ppl`` = exp(mean NLL
    over seeds) (perplexity), ``ppl_std`` (std over seeds of the per-seed perplexity), ``nll_mean``/``nll_std``
    (nats/token), ``seeds``, ``best`` and the test against the best row of its table at that length
    (``reference``/``reference_label``: that row's setting and label; ``test``: welch | bootstrap | n/a | best,
    ``p_value``, ``ci_low``/``ci_high``, ``significantly_worse``, ``windows``)."""
    groups = defaultdict(lambda: defaultdict(list))
    for rec in records:
        groups[eval_settings(rec)][(rec["order"], rec["setting"])].append(rec)
    ranked = sorted(groups, key=lambda g: _preference(g, sum(map(len, groups[g].values()))))
    rows = []
    for table, group in enumerate(ranked, 1):
        protocol, stride, split, scored, max_tokens, lengths = group
        head = {"table": table, "protocol": protocol, "stride": stride, "split": split, "scored_split": scored,
                "max_tokens": max_tokens, "lengths": list(lengths), "eval_settings": group}
        cells = {}
        for (_, setting), recs in sorted(groups[group].items()):
            recs = sorted(recs, key=lambda r: value_key(r["seed"]))
            for length in lengths:
                res = [next(r for r in rec["results"] if r["length"] == length) for rec in recs]
                cells[setting, length] = {**head, "setting": setting, "label": recs[0]["label"],
                                          "differs": recs[0]["differs"], "length": length, **_budget(recs[0]), **stats.summary(
                    [r["nll"] for r in res], [(r["window_nll"], r["window_tokens"]) if "window_nll" in r and
                                              "window_tokens" in r else None for r in res])}
        for length in lengths:
            column = [c for (_, n), c in cells.items() if n == length]
            stats.rank(column)
            best = next(c for c in column if c["best"])
            for c in column:
                c.update(reference=best["setting"], reference_label=best["label"])
        rows += cells.values()
    return rows


def _budget(rec: dict) -> dict:
    """A record's training: ``train_length`` (its own train length ``train.seq_len``, tokens), ``origin_length``
    (:func:`origin_length`: its line's first), ``train_tokens`` (its own), and for a fine-tuned run its ``method`` (its
    label without the step count: ``rope+yarn×4 ft512``), ``total_train_tokens`` (its parent's line's + its own) and
    ``parent`` (the setting of its parent's row: posbench/report/records.py finds it; None where it is not reported)."""
    lineage = rec.get("lineage")
    return {"train_length": rec["config"]["train"]["seq_len"], "origin_length": origin_length(rec),
            "train_tokens": rec.get("train_tokens"), "total_train_tokens": rec.get("total_train_tokens"),
            "method": run_label(rec["config"], lineage, steps=False) if lineage else None,
            "parent": rec.get("parent")}


# ---- what the plots draw --------------------------------------------------------------------------


def ppl_series(rows: list[dict]) -> dict[str, tuple[list, list]]:
    """{row label: (lengths, perplexity exp(mean NLL))} of the first table (validation split, nonoverlapping when
    present): wandb's chart."""
    first = min(r["table"] for r in rows)
    series = defaultdict(lambda: ([], []))
    for r in sorted((r for r in rows if r["table"] == first), key=lambda r: r["length"]):
        series[r["label"]][0].append(r["length"])
        series[r["label"]][1].append(r["ppl"])
    return dict(series)


def _at_longest(rows: list[dict]) -> list[dict]:
    """The plotted table's rows (the first: validation split, nonoverlapping when present) at its longest length."""
    first = min(r["table"] for r in rows)
    longest = max(r["length"] for r in rows if r["table"] == first)
    return [r for r in rows if r["table"] == first and r["length"] == longest]


def finetune_series(rows: list[dict]) -> dict[str, tuple[list, list]]:
    """{method: (fine-tuning tokens, perplexity at the longest evaluation length)} of the plotted table's fine-tuned
    rows (``method`` set by :func:`fold`), in token order: how each method improves with its budget; {} without any."""
    series = defaultdict(lambda: ([], []))
    for r in sorted((r for r in _at_longest(rows) if r.get("method")), key=lambda r: r["train_tokens"] or 0):
        series[r["method"]][0].append(r["train_tokens"] or 0)
        series[r["method"]][1].append(r["ppl"])
    return dict(series)


def finetune_parents(rows: list[dict]) -> dict[str, float]:
    """{row label: perplexity at the longest evaluation length} of the plotted table's rows that are the parent of
    one of its fine-tuned rows (a row's setting is a fine-tuned row's ``parent``): the weights before fine-tuning."""
    plotted = _at_longest(rows)
    parents = {r["parent"] for r in plotted if r.get("parent")}
    return {r["label"]: r["ppl"] for r in plotted if not r.get("method") and r["setting"] in parents}


def position_curves(records: list[dict], rows: list[dict], table: int) -> dict[tuple[str, int], tuple[list, list, list]]:
    """{(setting, longest length): (bin centres, NLL, tokens)} of one table's evaluation setting: each setting's NLL by
    token position (nats/token, 1-based bin centres) at its longest evaluation length T, mean over seeds, and how many
    tokens each bin averages per seed (windows × the bin's width: at T every window is whole; [] for a record without
    its window count).

    Under the sliding protocol (stride S) only the first window scores positions before T − S (0-based), so only the
    bins reaching T − S are kept, each centred on its part from T − S: positions every window scores. A bin that
    straddles T − S still averages its first window's earlier positions in, one window against all the others'."""
    group = next(r["eval_settings"] for r in rows if r["table"] == table)
    protocol, stride = group[:2]
    runs = defaultdict(list)
    for rec in records:
        if eval_settings(rec) == group:
            longest = max(rec["results"], key=lambda r: r["length"])
            runs[(rec["order"], rec["setting"], longest["length"])].append((longest["nll_by_position"],
                                                                            longest.get("windows")))
    curves = {}
    for (_, setting, length), seeds in sorted(runs.items()):
        by_position, windows = [p for p, _ in seeds], seeds[0][1]
        edges, first = by_position[0]["position"], length - stride if protocol == "sliding" else 0
        bins = [(i, max(a, first), b) for i, (a, b) in enumerate(zip(edges, [*edges[1:], length])) if b > first]
        curves[setting, length] = ([(a + b + 1) / 2 for _, a, b in bins],  # bin centres, 1-based positions
                                   [statistics.fmean(r["nll"][i] for r in by_position) for i, _, _ in bins],
                                   [windows * (b - a) for _, a, b in bins] if windows else [])
    return curves


def labels(records: list[dict]) -> dict[str, str]:
    """{setting: short row label} of every record, in row order: one colour (and line style) each, the same in every plot."""
    return {s: label for _, s, label in sorted({(r["order"], r["setting"], r["label"]) for r in records})}
