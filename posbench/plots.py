"""The report's plots, drawn from what they are given (posbench/compare.py and posbench/retrieval.py compute it,
posbench/report.py calls the functions here):

* ``ppl_vs_length.png`` — perplexity exp(mean NLL over seeds) against evaluation length, log2 x, ± std bands;
* ``loss_vs_position.png`` — NLL by token position at the longest evaluation length, mean over seeds;
* ``ppl_vs_finetune.png`` (:func:`draw_finetune`, when fine-tuned runs are reported) — perplexity at the longest
  evaluation length against fine-tuning tokens, one line per method;
* ``passkey_vs_distance.png`` and ``passkey_heatmap.png`` (:func:`draw_passkey`, when runs were probed) — retrieval
  accuracy against needle-to-query distance / L, and by needle depth × length;
* ``passkey_vs_tokens.png`` (:func:`draw_probe_curves`, when runs probed during training) — retrieval accuracy at L
  and at the longest probe length against training tokens: when copying forms, per scheme;
* ``context_vs_length.png`` (:func:`draw_context`, when runs measured context use) — the mean NLL difference past L
  (whole window − sliding window of L) against evaluation length, with its bootstrap interval.

The first two mark the train length L and give each setting one colour. matplotlib is imported when a plot is drawn, so
the rest of posbench starts without it.
"""

from __future__ import annotations

from pathlib import Path


def _styles(order: list[str]) -> dict[str, dict]:
    """One colour (and, past 10 settings, line style) per setting, the same in both plots."""
    return {name: {"color": f"C{i % 10}", "linestyle": ("-", "--", ":", "-.")[i // 10 % 4]} for i, name in enumerate(order)}


def draw(out: Path, train_length: int, title: str, table: list[dict], curves: dict[tuple[str, int], tuple[list, list]],
         order: list[str]) -> dict[str, Path]:
    """Write both plots into ``out``; return their paths.

    Args:
        train_length: L, marked by a vertical line.
        title: the evaluation setting in words (second line of each title).
        table: the plotted table's rows (``posbench.compare.fold``'s), each with ``setting``, ``length``, ``ppl``
            and ``ppl_std``: one line per setting, in the rows' order, with its ± std band.
        curves: {(setting, length): (1-based positions, NLL in nats/token)}, one line each.
        order: every setting, in the order that gives each its colour.
    """
    import matplotlib  # only here: a run that draws no plot never imports matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (after choosing the backend that draws to files)

    style = _styles(order)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for setting in dict.fromkeys(r["setting"] for r in table):
        xs, ys, sd = zip(*[(r["length"], r["ppl"], r["ppl_std"]) for r in table if r["setting"] == setting])
        ax.plot(xs, ys, marker="o", label=setting, **style[setting])
        ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)], alpha=0.2, color=style[setting]["color"])
    ax.set(xscale="log", yscale="log", xlabel="evaluation length (tokens)", ylabel="perplexity (exp mean NLL over seeds)",
           title=f"Perplexity vs evaluation length\n{title}")
    ax.set_xscale("log", base=2)
    _finish(plt, fig, ax, train_length, out / "ppl_vs_length.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (setting, length), (xs, ys) in curves.items():
        ax.plot(xs, ys, label=f"{setting} ({length})", **style[setting])
    ax.set(xscale="log", xlabel="token position in the window (1-based)", ylabel="NLL (nats/token, mean over seeds)",
           title=f"Loss by position at the longest evaluation length\n{title}")
    _finish(plt, fig, ax, train_length, out / "loss_vs_position.png")
    return {"ppl_vs_length": out / "ppl_vs_length.png", "loss_vs_position": out / "loss_vs_position.png"}


def draw_finetune(out: Path, series: dict[str, tuple[list, list]], length: int, title: str) -> Path:
    """Write ``ppl_vs_finetune.png``: for each method (``rope+yarn×4 ft512``), perplexity at evaluation length
    ``length`` against its fine-tuning tokens (0: the parent's weights as they are); return its path."""
    import matplotlib  # only here: a run that draws no plot never imports matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (after choosing the backend that draws to files)
    import matplotlib.ticker  # (plain numbers on the axis)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (method, (xs, ys)) in enumerate(series.items()):
        ax.plot(xs, ys, marker="o", label=method, color=f"C{i % 10}")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set(xlabel="fine-tuning tokens", ylabel=f"perplexity at length {length}",
           title=f"Perplexity at {length} tokens vs fine-tuning budget\n{title}")
    return _save(plt, fig, ax, out / "ppl_vs_finetune.png")


def draw_passkey(out: Path, distance: dict[str, tuple[list, list]], depth: dict[str, tuple[list, list, list]],
                 order: list[str]) -> dict[str, Path]:
    """Write the passkey probe's plots; return their paths.

    * ``passkey_vs_distance.png``: exact-match accuracy against needle-to-query distance in units of L (log2 x),
      one line per row label (``distance``: {label: (distances / L, accuracy)}), L marked at 1;
    * ``passkey_heatmap.png``: per row label, accuracy by needle depth (rows) × probe length (columns)
      (``depth``: {label: (depths, lengths, accuracy[depth][length])})."""
    import matplotlib  # only here: a run that draws no plot never imports matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (after choosing the backend that draws to files)

    style = _styles(order)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for setting, (xs, ys) in distance.items():
        ax.plot(xs, ys, marker="o", label=setting, **style[setting])
    ax.axvline(1.0, color="grey", linestyle="--", label="distance = L")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="needle-to-query distance / L", ylabel="exact-match accuracy", ylim=(-0.03, 1.03),
           title="Passkey retrieval vs distance")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "passkey_vs_distance.png", dpi=110)
    plt.close(fig)

    n = len(depth)
    cols = min(4, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False, layout="constrained")
    for ax, (setting, (depths, lengths, grid)) in zip(axes.flat, depth.items()):
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_title(setting, fontsize=8)
        ax.set(xlabel="length", ylabel="depth")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, shrink=0.8, label="exact-match accuracy")
    fig.savefig(out / "passkey_heatmap.png", dpi=110)
    plt.close(fig)
    return {"passkey_vs_distance": out / "passkey_vs_distance.png", "passkey_heatmap": out / "passkey_heatmap.png"}


def draw_context(out: Path, series: dict[str, tuple[list, list, list, list]], train_length: int,
                 order: list[str]) -> Path:
    """Write ``context_vs_length.png``: per row label (``series``: {label: (lengths, diff, ci_low, ci_high)}), the mean
    NLL_full − NLL_short past L (nats/token) against evaluation length (log2 x), error bars its 95% interval, a
    horizontal line at 0 (the context beyond L unused); return its path."""
    import matplotlib  # only here: a run that draws no plot never imports matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (after choosing the backend that draws to files)

    style = _styles(order)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for setting, (xs, ys, low, high) in series.items():
        ax.errorbar(xs, ys, yerr=[[y - a for y, a in zip(ys, low)], [b - y for y, b in zip(ys, high)]], marker="o",
                    capsize=3, label=setting, **style[setting])
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="evaluation length T (tokens)", ylabel="NLL whole window − NLL last ≤ L tokens (nats/token)",
           title=f"Context use past L = {train_length} (negative: uses context beyond L)")
    return _save(plt, fig, ax, out / "context_vs_length.png")


def _finish(plt, fig, ax, train_length: int, path: Path) -> None:
    ax.axvline(train_length, color="grey", linestyle="--", label=f"L = {train_length}")
    _save(plt, fig, ax, path)


def _save(plt, fig, ax, path: Path, **legend) -> Path:
    """Small title, legend (``legend``: its options beyond fontsize 8), tight layout, ``path`` at 110 dpi; the figure closed."""
    ax.title.set_fontsize(9)
    ax.legend(**{"fontsize": 8, **legend})
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_probe_curves(out: Path, curves: dict[str, dict[int, tuple[list, list]]], order: list[str]) -> Path:
    """Write ``passkey_vs_tokens.png``: exact-match accuracy against training tokens (log x), per row label one colour
    (``curves``: {label: {probe length: (tokens, accuracy)}}), a solid line at the shortest probe length (L) and a
    dashed one at the longest; return its path."""
    import matplotlib  # only here: a run that draws no plot never imports matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (after choosing the backend that draws to files)

    style = _styles(order)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for setting, by_length in curves.items():
        lengths = sorted(by_length)
        for length in lengths:
            xs, ys = by_length[length]
            ax.plot(xs, ys, marker=".", color=style[setting]["color"], linestyle="-" if length == lengths[0] else "--",
                    label=f"{setting} @ {length}")
    ax.set_xscale("log")
    ax.set(xlabel="training tokens", ylabel="exact-match accuracy", ylim=(-0.03, 1.03),
           title="Passkey retrieval during training (solid: at L, dashed: longest probe length)")
    return _save(plt, fig, ax, out / "passkey_vs_tokens.png", fontsize=7, ncol=2)
