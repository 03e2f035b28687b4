"""The report's two plots, of one evaluation setting (validation split and nonoverlapping when present):

* ``ppl_vs_length.png`` — perplexity exp(mean NLL over seeds) against evaluation length, log2 x, ± std bands;
* ``loss_vs_position.png`` — NLL by token position at the longest evaluation length, mean over seeds.

Both mark the train length L and give each setting one colour. Called by ``posbench.report.write_report``.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path


def _styles(records: list[dict]) -> dict[str, dict]:
    """One colour (and, past 10 settings, line style) per setting, the same in both plots."""
    names = [s for _, s in sorted({(r["order"], r["setting"]) for r in records})]
    return {name: {"color": f"C{i % 10}", "linestyle": ("-", "--", ":", "-.")[i // 10 % 4]} for i, name in enumerate(names)}


def draw(records: list[dict], rows: list[dict], out: Path, train_length: int) -> dict[str, Path]:
    """ppl_vs_length.png (log2 x, one line per setting, ± std bands, a line at L) and loss_vs_position.png
    (NLL in nats/token by token position at the longest length, mean over seeds) of the first table's
    evaluation setting (validation split and nonoverlapping when present); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from posbench.report import eval_settings, table_title

    sub = [r for r in rows if r["table"] == 1]
    style, title = _styles(records), table_title(sub[0])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for setting in dict.fromkeys(r["setting"] for r in sub):
        xs, ys, sd = zip(*[(r["length"], r["ppl"], r["ppl_std"]) for r in sub if r["setting"] == setting])
        ax.plot(xs, ys, marker="o", label=setting, **style[setting])
        ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)], alpha=0.2, color=style[setting]["color"])
    ax.set(xscale="log", yscale="log", xlabel="evaluation length (tokens)", ylabel="perplexity (exp mean NLL over seeds)",
           title=f"Perplexity vs evaluation length\n{title}")
    ax.set_xscale("log", base=2)
    _finish(fig, ax, train_length, out / "ppl_vs_length.png")

    group = sub[0]["eval_settings"]
    curves = defaultdict(list)
    for rec in records:
        if eval_settings(rec) == group:
            longest = max(rec["results"], key=lambda r: r["length"])
            curves[(rec["order"], rec["setting"], longest["length"])].append(longest["nll_by_position"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (_, setting, length), runs in sorted(curves.items()):
        edges = runs[0]["position"]
        xs = [(a + b + 1) / 2 for a, b in zip(edges, [*edges[1:], length])]  # bin centres, 1-based positions
        ax.plot(xs, [statistics.fmean(v) for v in zip(*(r["nll"] for r in runs))], label=f"{setting} ({length})", **style[setting])
    ax.set(xscale="log", xlabel="token position in the window (1-based)", ylabel="NLL (nats/token, mean over seeds)",
           title=f"Loss by position at the longest evaluation length\n{title}")
    _finish(fig, ax, train_length, out / "loss_vs_position.png")
    return {"ppl_vs_length": out / "ppl_vs_length.png", "loss_vs_position": out / "loss_vs_position.png"}


def _finish(fig, ax, train_length: int, path: Path) -> None:
    import matplotlib.pyplot as plt

    ax.title.set_fontsize(9)
    ax.axvline(train_length, color="grey", linestyle="--", label=f"L = {train_length}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ppl_series(rows: list[dict]) -> dict[str, tuple[list, list]]:
    """{setting: (lengths, perplexity exp(mean NLL))} of the plotted table (the first: validation split,
    nonoverlapping when present)."""
    first = min(r["table"] for r in rows)
    series = defaultdict(lambda: ([], []))
    for r in sorted((r for r in rows if r["table"] == first), key=lambda r: r["length"]):
        series[r["setting"]][0].append(r["length"])
        series[r["setting"]][1].append(r["ppl"])
    return dict(series)
