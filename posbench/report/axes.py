"""What the report's plots write on their axes (posbench/report/plots.py draws the lines and calls these):

* :func:`plain_ticks` — every log axis in plain numbers (``2400``, ``0.5``; ``2.5e6`` from a million on);
* :func:`value_ticks` — a perplexity axis gets 4 to 8 round values to read from (``110 115 120 125`` on a flat panel,
  ``120 150 200 250 300 400`` on one spanning 116–474), not only the one or three matplotlib's log locator picks;
* :func:`min_span` — a perplexity axis spans at least a factor :data:`MIN_SPAN`, so a small change looks small;
* :func:`label_ends` — each line's label written at its end, in the margin right of the axes, the labels pushed apart
  so that none overlaps another: six flat rows in one band stay readable without matching colours to a legend.

Everything here works on matplotlib objects handed to it; matplotlib's own modules are imported inside the functions,
so posbench starts without it.
"""

from __future__ import annotations

import math
import textwrap

FONT = 8  # tick-label and line-end label size, points
MIN_SPAN = 1.2  # the least ratio of a perplexity axis's upper to lower limit
LADDERS = ((1,), (1, 2, 5), (1, 2, 3, 5), (1, 1.5, 2, 3, 4, 5, 6, 8), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8))  # × 10^k
MOST_TICKS = 8  # the most value ticks on a perplexity axis …
LEAST_TICKS = 4  # … and the least, where round values allow
LABEL_GAP = 1.5  # the height a line of a line-end label takes, in its font's size (no two overlap)
LABEL_WIDTH = 26  # characters: a longer line-end label is wrapped


def plain(x: float) -> str:
    """A tick value as a plain number: ``2400``, ``0.125``; ``2.5e6`` from a million on."""
    if x < 1e6:
        return f"{x:.6g}"
    mantissa, exponent = f"{x:.3g}".split("e")
    return f"{mantissa}e{int(exponent)}"


def plain_ticks(fig) -> None:
    """Every log axis of ``fig`` labelled in plain numbers (:func:`plain`). An axis with :func:`value_ticks` keeps
    exactly those labels, its minor ticks unlabelled; on any other, which minor ticks get a label is matplotlib's
    LogFormatter's choice, so the labels do not crowd: all of them across less than 0.4 of a decade, those at 2, 3, 4
    and 6 (× a power of the base) while at most one power of the base is in view, none once two are."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogFormatter, NullFormatter  # (plots only)

    class Plain(LogFormatter):
        def __call__(self, x, pos=None):
            return plain(x) if super().__call__(x, pos) else ""

    for axis in (a for ax in fig.axes for a in (ax.xaxis, ax.yaxis) if a.get_scale() == "log"):
        if isinstance(axis.get_major_locator(), FixedLocator):
            axis.set_major_formatter(FuncFormatter(lambda x, pos: plain(x)))
            axis.set_minor_formatter(NullFormatter())
        else:
            axis.set_major_formatter(Plain(axis.get_transform().base))
            axis.set_minor_formatter(Plain(axis.get_transform().base))


def min_span(ax, values: list[float]) -> None:
    """Widen the perplexity axis of ``ax`` when ``values`` (what it draws, all > 0) span less than a factor
    :data:`MIN_SPAN`: its limits become √(min·max) divided and multiplied by √MIN_SPAN, a factor MIN_SPAN apart and
    centred geometrically on the values, so a change of 0.4% is a small step rather than the panel's height."""
    low, high = min(values), max(values)
    if high < MIN_SPAN * low:
        middle, half = math.sqrt(low * high), math.sqrt(MIN_SPAN)
        ax.set_ylim(middle / half, middle * half)


def round_values(low: float, high: float) -> list[float]:
    """Round values between ``low`` and ``high`` (> 0) for a log axis, :data:`LEAST_TICKS` to :data:`MOST_TICKS` of
    them where round values allow: the finest of :data:`LADDERS` (1, 2, 5 × 10^k …) that gives at most MOST_TICKS;
    where that gives fewer than LEAST_TICKS (a span under about 1.5×, where a log axis is nearly linear), evenly
    spaced multiples of the largest step of 1, 2, 2.5 or 5 × 10^k that gives at least LEAST_TICKS; [] for more than
    MOST_TICKS decades (matplotlib's own log ticks then)."""
    decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
    best = []
    for ladder in LADDERS:
        values = [round(m * 10.0 ** k, 12) for k in decades for m in ladder if low <= m * 10.0 ** k <= high]
        if len(values) > MOST_TICKS:
            break
        best = values
    if len(best) >= LEAST_TICKS:
        return best
    for k in range(math.floor(math.log10(high - low)), math.floor(math.log10(high - low)) - 3, -1):
        for m in (5, 2.5, 2, 1):
            step = m * 10.0 ** k
            values = [round(i * step, 12) for i in range(math.ceil(low / step), math.floor(high / step) + 1)]
            if len(values) >= LEAST_TICKS:
                return values
    return best


def value_ticks(ax) -> None:
    """Put :func:`round_values` of ``ax``'s y view on its (log) y axis as its labelled ticks, keeping the limits."""
    from matplotlib.ticker import FixedLocator  # (plots only)

    low, high = ax.get_ylim()
    values = round_values(low, high)
    if values:
        ax.yaxis.set_major_locator(FixedLocator(values))
        ax.set_ylim(low, high)


def label_ends(fig, ends: dict) -> None:
    """Write each line's label at its end, in the margin right of its axes, in its colour and joined to the end by a
    thin line; call it when the figure's layout is final but for these labels (its legend placed). A label longer than
    :data:`LABEL_WIDTH` characters is wrapped; the labels start at the heights of their lines' ends and are pushed
    apart to at least :data:`LABEL_GAP` font heights a line (the font shrinking where the axes are too short for all of
    them at :data:`FONT` − 1 points), within the axes' height.

    Args:
        ends: {axes: [(label, x, y, colour), …]}: each line's last point, in data coordinates.
    """
    fig.draw_without_rendering()  # the layout, so that the axes' height in points is known
    for ax, marks in ends.items():
        if not marks:
            continue
        height = ax.bbox.height * 72 / fig.dpi  # points
        texts = [textwrap.fill(label, LABEL_WIDTH) for label, *_ in marks]
        lines = sum(t.count("\n") + 1 for t in texts)
        size = min(FONT - 1, height / (LABEL_GAP * lines))
        wanted = sorted((_fraction(ax, y), text, x, y, colour) for text, (_, x, y, colour) in zip(texts, marks))
        tall = [LABEL_GAP * size / height * (w[1].count("\n") + 1) for w in wanted]  # axes fraction
        for place, (_, text, x, y, colour) in zip(_spread([w[0] for w in wanted], tall), wanted):
            ax.annotate(text, (x, y), xytext=(1.03, place), textcoords="axes fraction", ha="left", va="center",
                        fontsize=size, color=colour, annotation_clip=False, linespacing=1.0,
                        arrowprops={"arrowstyle": "-", "color": colour, "linewidth": 0.6, "shrinkA": 1, "shrinkB": 3})


def _fraction(ax, y: float) -> float:
    """Where ``y`` (data) sits on the y axis of ``ax``, as a fraction of its height (log or linear)."""
    low, high = ax.get_ylim()
    if ax.get_yscale() == "log":
        return (math.log(y) - math.log(low)) / (math.log(high) - math.log(low))
    return (y - low) / (high - low)


def _spread(wanted: list[float], tall: list[float]) -> list[float]:
    """Centres near ``wanted`` (ascending fractions of the axes' height) of labels ``tall`` high (the same unit) that do
    not overlap and stay within 0 … 1 where they fit: pushed up from the lowest, then down from the top."""
    places = []
    for i, w in enumerate(wanted):
        places.append(max(w, places[-1] + (tall[i - 1] + tall[i]) / 2) if places else max(w, tall[0] / 2))
    for i in range(len(places) - 1, -1, -1):
        top = 1 - tall[i] / 2 if i == len(places) - 1 else places[i + 1] - (tall[i] + tall[i + 1]) / 2
        places[i] = min(places[i], top)
    return places
