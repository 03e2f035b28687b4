"""The report's plots, drawn from what they are given (posbench/report/compare.py and posbench/evaluation/retrieval.py compute it,
posbench/report/render.py calls the functions here):

* ``ppl_vs_length.png`` — perplexity exp(mean NLL over seeds) against evaluation length, log2 x, ± std bands, a
  panel per evaluation setting (the report's tables), each line's label at its end, 4 to 8 round values on the y axis;
* ``loss_vs_position.png`` — NLL by token position at the longest evaluation length, mean over seeds, a panel per
  evaluation setting, each line's label at its end; under the sliding protocol only the positions every window scores
  (its x label says which, and how many tokens a point averages: the first bins fewest, so they move most);
* ``ppl_vs_finetune.png`` (:func:`draw_finetune`, when fine-tuned runs are reported) — perplexity at the longest
  evaluation length against fine-tuning tokens, one line per method;
* ``passkey_vs_distance.png`` and ``passkey_heatmap.png`` (:func:`draw_passkey`, when runs were probed) — retrieval
  accuracy against needle-to-query distance / L, and by needle depth × length;
* ``passkey_vs_tokens.png`` (:func:`draw_probe_curves`, when runs probed during training) — retrieval accuracy at L
  and at the longest probe length against training tokens: when copying forms, per scheme;
* ``context_vs_length.png`` (:func:`draw_context`, when runs measured context use) — the mean NLL difference past L
  (whole window − sliding window of L) against evaluation length, with its bootstrap interval.

Every plot names its rows by their short labels (posbench/report/compare.py ``labels``: ``rope, base=500.0``; report.md's
legend tables give their settings), gives each row one colour in every plot, and puts its legend below the axes, never over
them. Every log axis prints plain numbers (``2400``, ``0.5``; ``2.5e6`` from a million on), its minor ticks labelled only
where they do not crowd (posbench/report/axes.py). A perplexity axis spans at least a factor 1.2 (axes.py's
``MIN_SPAN``), so a small change looks small. The first two mark in each panel the train lengths of its runs (a
fine-tuned run's own and its line's first L), each value written at its line. matplotlib is imported when a plot is
drawn, so the rest of posbench starts without it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from posbench.report.axes import FONT, LABEL_WIDTH, label_ends, min_span, plain_ticks, value_ticks

WIDTH = 7.2  # figure width, inches
PANEL = 2.9  # height of one panel, inches
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">", "*", "h")  # hollow, one per row (cycled)


def _pyplot():
    """matplotlib.pyplot drawing to files (imported here: a run that draws no plot never imports matplotlib)."""
    import matplotlib  # only here: a run that draws no plot never imports matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (after choosing the backend that draws to files)

    return plt


def _styles(labels: dict[str, str]) -> dict[str, dict]:
    """{setting: line style}: per setting of ``labels`` (in its order) one colour (and, past 10 settings, line style),
    hollow marker and short label, the same in every plot; a later row's line and marker are thinner and smaller, so
    rows with equal numbers show as nested markers and a thin line on a thick one rather than one line."""
    shrink = [i / max(1, len(labels) - 1) for i in range(len(labels))]
    return {s: {"color": f"C{i % 10}", "linestyle": ("-", "--", ":", "-.")[i // 10 % 4], "label": label,
                "marker": MARKERS[i % len(MARKERS)], "fillstyle": "none", "markersize": 9 - 5 * shrink[i],
                "linewidth": 2.8 - 1.8 * shrink[i]} for i, (s, label) in enumerate(labels.items())}


def _legend_rows(n: int, longest: int) -> tuple[int, int]:
    """(columns, rows) of a legend of ``n`` entries, the longest ``longest`` characters, across the figure's width."""
    columns = max(1, min(n, int(WIDTH // (0.07 * longest + 0.6))))
    return columns, -(-n // columns)


def _figure(plt, panels: int, entries: int = 0, longest: int = 1, columns: int = 1):
    """A figure of ``panels`` axes (``columns`` across) with room below them for a legend of ``entries`` entries,
    the longest ``longest`` characters."""
    rows = -(-panels // columns)
    height = PANEL * rows + 0.6 + 0.2 * _legend_rows(entries, longest)[1]
    fig, axes = plt.subplots(rows, columns, figsize=(WIDTH, height), squeeze=False, layout="constrained")
    for ax in list(axes.flat)[panels:]:
        ax.axis("off")
    return fig, list(axes.flat)[:panels]


def _save(plt, fig, path: Path, handles: list, ends: dict | None = None) -> Path:
    """``handles`` as one legend below the axes, plain tick labels (:func:`posbench.report.axes.plain_ticks`) at the
    figure's font size, each line's label at its end (``ends``: :func:`posbench.report.axes.label_ends`'s), ``path``
    at 110 dpi; the figure closed."""
    plain_ticks(fig)
    for ax in fig.axes:
        ax.tick_params(which="both", labelsize=FONT)
    columns, _ = _legend_rows(len(handles), max((len(h.get_label()) for h in handles), default=1))
    fig.legend(handles=handles, loc="outside lower center", ncol=columns, fontsize=FONT)
    if ends:
        label_ends(fig, ends)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _handles(styles: list[dict], marked: bool = False) -> list:
    """Legend entries: one line per style (its colour, line style, marker and label), and, when ``marked``, the
    train lengths' dashed grey line."""
    from matplotlib.lines import Line2D  # (matplotlib: imported only where a plot is drawn)

    return ([Line2D([], [], **style) for style in styles]
            + ([Line2D([], [], color="grey", linestyle="--", label="train length L (value at the line)")] if marked else []))


def _title(text: str, width: int = 95) -> str:
    """``text`` wrapped at ``width`` characters, each of its lines on its own."""
    return "\n".join(textwrap.fill(line, width) for line in text.split("\n"))


def draw(out: Path, tables: list[tuple[str, list[dict], dict]], labels: dict[str, str]) -> dict[str, Path]:
    """Write ``ppl_vs_length.png`` and ``loss_vs_position.png`` into ``out``, a panel per evaluation setting; return
    their paths.

    Args:
        tables: one (title, rows, curves) per evaluation setting, in the report's table order: ``title`` the setting in
            words (``1. nonoverlapping, validation split, …``); ``rows`` its rows (``posbench.report.compare.fold``'s), each
            with ``setting``, ``length``, ``ppl`` and ``ppl_std``: a line per setting with its ± std band (the
            perplexity axis spans at least a factor 1.2: posbench/report/axes.py's ``min_span``), ``train_length``
            and ``origin_length`` (tokens): a vertical line at each, its value written at it, and ``protocol``,
            ``stride`` and ``lengths``;
            ``curves`` {(setting, length): (1-based positions, NLL in nats/token, tokens per point)}: a line each
            (``posbench.report.compare.position_curves``: under the sliding protocol, the positions every window
            scores), the x label saying how many tokens a point averages (:func:`_positions`).
        labels: {setting: short label} of every row, in the order that gives each its colour.

    Each line's label is written at its end (:func:`posbench.report.axes.label_ends`), and a perplexity axis gets 4 to
    8 round values as ticks (:func:`posbench.report.axes.value_ticks`).
    """
    return {"ppl_vs_length": draw_ppl(out, [(title, rows) for title, rows, _ in tables], labels),
            "loss_vs_position": draw_loss(out, tables, labels)}


def draw_ppl(out: Path, tables: list[tuple[str, list[dict]]], labels: dict[str, str],
             name: str = "ppl_vs_length.png") -> Path:
    """Write ``name`` (``ppl_vs_length.png``) into ``out``: :func:`draw`'s perplexity plot of ``tables`` ((title, rows)
    per evaluation setting, as :func:`draw`'s without curves); return its path."""
    plt = _pyplot()
    style = _styles(labels)
    shown = [s for s in labels if any(r["setting"] == s for _, rows in tables for r in rows)]
    longest = max(len(labels[s]) for s in shown)
    fig, axes = _figure(plt, len(tables), len(shown) + 1, longest)
    ends = {}
    for ax, (title, rows) in zip(axes, tables):
        ends[ax] = []
        for setting in dict.fromkeys(r["setting"] for r in rows):
            xs, ys, sd = zip(*[(r["length"], r["ppl"], r["ppl_std"]) for r in rows if r["setting"] == setting])
            ax.plot(xs, ys, **style[setting])
            ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)], alpha=0.2,
                            color=style[setting]["color"])
            ends[ax].append((labels[setting], xs[-1], ys[-1], style[setting]["color"]))
        ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        min_span(ax, [v for r in rows for v in (r["ppl"] - r["ppl_std"], r["ppl"], r["ppl"] + r["ppl_std"]) if v > 0])
        value_ticks(ax)
        _panel(ax, rows, title, "evaluation length (tokens)", "perplexity", longest)
    fig.suptitle("Perplexity (exp mean NLL over seeds) vs evaluation length", fontsize=10)
    return _save(plt, fig, out / name, _handles([style[s] for s in shown], marked=True), ends)


def draw_loss(out: Path, tables: list[tuple[str, list[dict], dict]], labels: dict[str, str]) -> Path:
    """Write ``loss_vs_position.png`` into ``out``: :func:`draw`'s loss-by-position plot; return its path."""
    plt = _pyplot()
    style = _styles(labels)
    shown = [s for s in labels if any(r["setting"] == s for _, rows, _ in tables for r in rows)]
    longest = max(len(labels[s]) for s in shown)
    fig, axes = _figure(plt, len(tables), len(shown) + 1, longest)
    ends = {}
    for ax, (title, rows, curves) in zip(axes, tables):
        ends[ax] = []
        for (setting, length), (xs, ys, _) in curves.items():
            ax.plot(xs, ys, markevery=max(1, len(xs) // 8), **{**style[setting], "label": f"{labels[setting]} ({length})"})
            ends[ax].append((labels[setting], xs[-1], ys[-1], style[setting]["color"]))
        ax.set_xscale("log")
        _panel(ax, rows, title, _positions(rows[0], [n for _, _, tokens in curves.values() for n in tokens]),
               "NLL (nats/token)", longest)
    fig.suptitle("Loss by position at each setting's longest evaluation length (mean over seeds)", fontsize=10)
    return _save(plt, fig, out / "loss_vs_position.png", _handles([style[s] for s in shown], marked=True), ends)


def _positions(row: dict, counts: list[int]) -> str:
    """The x label of a loss-by-position panel of ``row``'s table: which positions it draws, and how many tokens a
    point averages (``counts``, per seed): the first bins are the narrowest, so they move most from bin to bin, and
    every row averages the same tokens there, so the rows move together."""
    which = "token position in the window (1-based)"
    if row["protocol"] == "sliding":
        length, stride = max(row["lengths"]), row["stride"]
        which += (f", only those every window scores: ≥ T − S + 1 = {length - stride + 1} (T = {length}, "
                  f"stride S = {stride})")
    if not counts:
        return which
    return (f"{which}\na point averages {min(counts):,} to {max(counts):,} tokens (the first bins fewest), the same "
            "in every row")


def _panel(ax, rows: list[dict], title: str, xlabel: str, ylabel: str, margin: int = 0) -> None:
    """Label a panel (its title and x label wrapped to leave room for ``margin`` characters of labels at the lines'
    ends) and mark the train lengths of its ``rows`` (``train_length``, ``origin_length``, tokens): a dashed
    grey vertical line at each, ``L = 512`` written along it on a pale box (readable over the lines)."""
    for length in sorted({r[key] for r in rows for key in ("train_length", "origin_length")}):
        ax.axvline(length, color="grey", linestyle="--")
        ax.annotate(f"L = {length}", (length, 1), xycoords=ax.get_xaxis_transform(), xytext=(2, -3),
                    textcoords="offset points", rotation=90, ha="left", va="top", fontsize=FONT - 1, color="0.3",
                    bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8})
    width = max(40, 95 - int(0.9 * min(margin, LABEL_WIDTH)))  # characters: an end label's font is 7/9 of the title's
    ax.set_xlabel(_title(xlabel, width + 10), fontsize=FONT)
    ax.set_ylabel(ylabel, fontsize=FONT)
    ax.set_title(_title(title, width), fontsize=FONT + 1)


def draw_finetune(out: Path, series: dict[str, tuple[list, list]], parents: dict[str, float], length: int,
                  title: str) -> Path:
    """Write ``ppl_vs_finetune.png``: for each method (``rope+yarn×4 ft512``), perplexity at evaluation length
    ``length`` against its fine-tuning tokens (0: the method applied to the parent's weights), and each parent's
    perplexity there (``parents``: {label: perplexity}) as a dotted horizontal line, the axis spanning at least a
    factor 1.2 (posbench/report/axes.py's ``MIN_SPAN``); return its path."""
    plt = _pyplot()
    import matplotlib.ticker  # (plain numbers on the axis)

    styles = list(_styles({method: method for method in series}).values())
    names = [*series, *(f"{label} (parent, not fine-tuned)" for label in parents)]
    fig, (ax,) = _figure(plt, 1, len(names), max(map(len, names)))
    for style, (xs, ys) in zip(styles, series.values()):
        ax.plot(xs, ys, **style)
    for i, (label, ppl) in enumerate(parents.items()):
        styles.append({"color": "0.4", "linestyle": (":", "-.", "--")[i % 3], "linewidth": 1.2,
                       "label": names[len(series) + i]})
        ax.axhline(ppl, **styles[-1])
    ax.set_xlim(left=-0.04 * max(max(xs, default=0) for xs, _ in series.values()) or None)  # from 0 fine-tuning tokens
    min_span(ax, [*(y for _, ys in series.values() for y in ys), *parents.values()])
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set(xlabel="fine-tuning tokens", ylabel=f"perplexity at length {length}")
    ax.set_title(_title(f"Perplexity at {length} tokens vs fine-tuning budget. {title}"), fontsize=FONT + 1)
    return _save(plt, fig, out / "ppl_vs_finetune.png", _handles(styles))


def draw_passkey(out: Path, distance: dict[str, tuple[list, list]], depth: dict[str, tuple[list, list, list]],
                 labels: dict[str, str], title: str) -> dict[str, Path]:
    """Write the passkey probe's plots of one probe table (``title``: which, in words); return their paths.

    * ``passkey_vs_distance.png``: exact-match accuracy against needle-to-query distance in units of L (log2 x),
      one line per row (``distance``: {setting: (distances / L, accuracy)}), L marked at 1;
    * ``passkey_heatmap.png``: per row, accuracy by needle depth (rows) × probe length (columns)
      (``depth``: {setting: (depths, lengths, accuracy[depth][length])}), titled with its short label.

    ``labels``: {setting: short label} of every row, in the order that gives each its colour."""
    plt = _pyplot()
    style = _styles(labels)
    fig, (ax,) = _figure(plt, 1, len(distance) + 1, max(len(labels[s]) for s in distance))
    for setting, (xs, ys) in distance.items():
        ax.plot(xs, ys, **style[setting])
    ax.axvline(1.0, color="grey", linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="needle-to-query distance / L", ylabel="exact-match accuracy", ylim=(-0.03, 1.03))
    ax.set_title(_title(f"Passkey retrieval vs distance. {title}"), fontsize=FONT + 1)
    from matplotlib.lines import Line2D  # (matplotlib: imported only where a plot is drawn)

    _save(plt, fig, out / "passkey_vs_distance.png", _handles([style[s] for s in distance])
          + [Line2D([], [], color="grey", linestyle="--", label="distance = L")])

    fig, axes = _figure(plt, len(depth), columns=min(4, len(depth)))
    for ax, (setting, (depths, lengths, grid)) in zip(axes, depth.items()):
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7, rotation=90)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_title(_title(labels[setting], 24), fontsize=FONT)
        ax.set_xlabel("length", fontsize=FONT)
        ax.set_ylabel("depth", fontsize=FONT)
    fig.colorbar(image, ax=axes, shrink=0.8, label="exact-match accuracy")
    fig.suptitle(_title(f"Passkey accuracy by needle depth × length. {title}"), fontsize=FONT + 1)
    fig.savefig(out / "passkey_heatmap.png", dpi=110)
    plt.close(fig)
    return {"passkey_vs_distance": out / "passkey_vs_distance.png", "passkey_heatmap": out / "passkey_heatmap.png"}


def draw_context(out: Path, series: dict[str, tuple[list, list, list, list]], train_length: int,
                 labels: dict[str, str]) -> Path:
    """Write ``context_vs_length.png``: per row (``series``: {setting: (lengths, diff, ci_low, ci_high)}), the mean
    NLL_full − NLL_short past L (nats/token) against evaluation length (log2 x), error bars its 95% interval, a
    horizontal line at 0 (the context beyond L unused); the title says what NLL_full and NLL_short are, so that the
    y label is short enough to fit; return its path. ``labels``: as :func:`draw`'s."""
    plt = _pyplot()
    style = _styles(labels)
    fig, (ax,) = _figure(plt, 1, len(series), max(len(labels[s]) for s in series))
    for setting, (xs, ys, low, high) in series.items():
        ax.errorbar(xs, ys, yerr=[[y - a for y, a in zip(ys, low)], [b - y for y, b in zip(ys, high)]], capsize=3,
                    **style[setting])
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation length T (tokens)", fontsize=FONT)
    ax.set_ylabel("NLL_full − NLL_short (nats/token)", fontsize=FONT)
    ax.set_title(_title(f"Context use past L = {train_length}: mean NLL_full − NLL_short of the tokens at positions ≥ L, "
                        "NLL_full with the whole window before each token as context, NLL_short with at most the last L "
                        "tokens (negative: the model uses context beyond L)"), fontsize=FONT + 1)
    return _save(plt, fig, out / "context_vs_length.png", _handles([style[s] for s in series]))


def draw_probe_curves(out: Path, curves: dict[str, dict[int, tuple[list, list]]], labels: dict[str, str],
                      transfer: dict[str, dict[int, tuple[list, list]]] | None = None) -> Path:
    """Write ``passkey_vs_tokens.png``: exact-match accuracy against training tokens (log x), per row one colour
    (``curves``: {setting: {probe length: (tokens, accuracy)}}), a solid line at the shortest probe length (L) and a
    dashed one at the longest; ``transfer`` (the same for the transfer control's keys) as hollow markers on thin
    lines; return its path. ``labels``: as :func:`draw`'s."""
    plt = _pyplot()
    style = _styles(labels)
    both = [("", curves), (" transfer", transfer or {})]
    entries = [(s, n, tag) for tag, series in both for s, by_length in series.items() for n in sorted(by_length)]
    names = {(s, n, tag): f"{labels[s]} @ {n}{tag}" for s, n, tag in entries}
    fig, (ax,) = _figure(plt, 1, len(entries), max(map(len, names.values())))
    handles = []
    for tag, series in both:
        for setting, by_length in series.items():
            lengths = sorted(by_length)
            for length in lengths:
                xs, ys = by_length[length]
                handles += ax.plot(xs, ys, marker="o" if tag else ".", color=style[setting]["color"],
                                   markerfacecolor="none" if tag else None, linewidth=0.8 if tag else 1.5,
                                   linestyle="-" if length == lengths[0] else "--", label=names[setting, length, tag])
    ax.set_xscale("log")
    ax.set(xlabel="training tokens", ylabel="exact-match accuracy", ylim=(-0.03, 1.03))
    ax.set_title("Passkey retrieval during training (solid: at L, dashed: longest probe length; hollow, thin: the "
                 "transfer control's keys)", fontsize=FONT + 1)
    return _save(plt, fig, out / "passkey_vs_tokens.png", handles)
