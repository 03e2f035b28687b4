"""The report's plots as drawn (posbench/report/plots.py; issue 39 item 7), read from their matplotlib figures rather
than their pixels: ``Figure.savefig`` and ``pyplot.close`` are replaced so that every figure a report draws stays
open and inspectable (tests/fixtures/report_mix, as in tests/test_report_mix.py).

* every log axis prints plain numbers (``2400``, ``0.5``, ``1e6``), never ``2.4×10³`` or ``2⁷``, and no two of its
  tick labels overlap;
* a perplexity axis spans at least a factor 1.2, centred geometrically on what it draws;
* each panel marks, with its value written at the line, the train length of every run drawn in it;
* the context plot's labels lie inside the figure;
* a sliding-window panel of ``loss_vs_position.png`` draws only the positions every window scores;
* six flat rows within a few percent of each other (issue 50 item 4) each get their label at their line's end, no
  two overlapping, all inside the figure, and a y axis with at least four values to read them by;
* a loss-by-position panel says how many tokens its first and last points average (windows × bin width).
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest

from posbench.report import compare, plots, render
from posbench.report.records import collect
from posbench.report.settings import eval_settings

MIX = Path(__file__).parent / "fixtures" / "report_mix"
PLAIN = re.compile(r"\d+(\.\d+)?(e\d+)?")  # 2400, 0.125, 1e6, 2.5e6
SPAN = 1.2  # the least ratio of a perplexity axis's y-limits


@pytest.fixture(scope="module")
def mix():
    """(records, rows) of tests/fixtures/report_mix."""
    records, _ = collect([MIX])
    return records, compare.fold(records)


@pytest.fixture
def drawn(monkeypatch):
    """{file name: figure} of every figure saved while the test runs, drawn (``fig.canvas.draw()``) and left open
    until the test ends."""
    plt = plots._pyplot()
    from matplotlib.figure import Figure  # (after plots chose the backend)

    figures = {}
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **_: figures.__setitem__(Path(path).name, fig))
    monkeypatch.setattr(plt, "close", lambda fig=None: None)
    yield figures
    monkeypatch.undo()
    plt.close("all")


def report(records, rows, out: Path, figures: dict) -> dict:
    """The report's figures of ``records`` (render.py's ``_draw``), each drawn."""
    render._draw(out, records, rows, [])
    for fig in figures.values():
        fig.canvas.draw()
    return figures


def panels(fig) -> list:
    """The axes of a figure that draw something (not the empty cells of its grid)."""
    return [ax for ax in fig.axes if ax.axison]


def shown_ticks(axis) -> list:
    """The tick labels of ``axis`` (major and minor) inside its view that print something, as Text objects."""
    low, high = sorted(axis.get_view_interval())
    ticks = [*axis.get_major_ticks(), *axis.get_minor_ticks()]
    return [t.label1 for t in ticks if low <= t.get_loc() <= high and t.label1.get_visible() and t.label1.get_text()]


def data_lines(ax) -> list:
    """The lines of ``ax`` that draw rows (labelled), not its markers."""
    return [line for line in ax.lines if not line.get_label().startswith("_")]


def marks(ax) -> dict[float, list[str]]:
    """{x: the texts written at it} of every vertical line of ``ax`` (``axvline``: y from 0 to 1 of the axes)."""
    xs = [line.get_xdata()[0] for line in ax.lines if list(line.get_ydata()) == [0, 1]]
    return {x: [t.get_text() for t in ax.texts if getattr(t, "xy", (None,))[0] == x] for x in xs}


def test_log_axes_print_plain_numbers_that_do_not_overlap(mix, tmp_path, drawn):
    report(*mix, tmp_path, drawn)
    plots.draw_context(tmp_path, {"rope": ([256, 512, 1024], [0.05, 0.1, 0.2], [0.04, 0.09, 0.18], [0.06, 0.11, 0.22])},
                       128, {"rope": "rope"})
    plots.draw_probe_curves(tmp_path, {"rope": {32: ([1e5, 1e6, 3e6], [0.0, 0.5, 1.0])}}, {"rope": "rope"})
    axes = [(name, ax, axis) for name, fig in drawn.items() for ax in panels(fig) for axis in (ax.xaxis, ax.yaxis)
            if axis.get_scale() == "log"]
    assert len(axes) == 12, [name for name, _, _ in axes]  # ppl: 3 panels × 2, loss: 3 × x; passkey, context, probe: x
    for fig in drawn.values():
        fig.canvas.draw()
    for name, ax, axis in axes:
        labels = shown_ticks(axis)
        assert len(labels) >= 2, (name, ax.get_title())
        assert all(PLAIN.fullmatch(t.get_text()) for t in labels), (name, [t.get_text() for t in labels])
        boxes = [t.get_window_extent() for t in labels]
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), (
            name, [t.get_text() for t in labels])
    tokens = shown_ticks(next(ax for name, ax, _ in axes if name == "passkey_vs_tokens.png").xaxis)
    assert "1e6" in [t.get_text() for t in tokens]


def test_a_perplexity_axis_spans_at_least_a_factor_1_2(mix, tmp_path, drawn):
    records, rows = mix
    report(records, rows, tmp_path, drawn)
    for ax in [*panels(drawn["ppl_vs_length.png"]), *panels(drawn["ppl_vs_finetune.png"])]:
        low, high = ax.get_ylim()
        assert high / low >= SPAN * (1 - 1e-9), (ax.get_title(), low, high)
    one_run = [r["ppl"] for r in rows if r["table"] == 3]  # rope (yarn×4 at eval), one seed: no band
    low, high = panels(drawn["ppl_vs_length.png"])[2].get_ylim()
    assert math.sqrt(low * high) == pytest.approx(math.sqrt(min(one_run) * max(one_run)))
    assert high / low == pytest.approx(SPAN)


def test_each_panel_marks_the_train_lengths_of_its_runs(mix, tmp_path, drawn):
    report(*mix, tmp_path, drawn)
    expected = [{32, 128, 512}, {32}, {32}]  # table 1: runs fine-tuned at 128 and 512 from rope at L = 32
    for name in ("ppl_vs_length.png", "loss_vs_position.png"):
        for ax, lengths in zip(panels(drawn[name]), expected):
            assert marks(ax) == {n: [f"L = {n}"] for n in lengths}, (name, ax.get_title())


def test_the_context_plot_keeps_its_labels_inside_the_figure(tmp_path, drawn):
    labels = {f"run {i}": f"rope+LLLG(w{i}, G=rope[base=1e+06], qknorm)" for i in range(13)}
    series = {s: ([256, 512, 1024, 2048], [0.05, 0.1, 0.2, 0.3], [0.04, 0.09, 0.18, 0.28], [0.06, 0.11, 0.22, 0.32])
              for s in labels}
    plots.draw_context(tmp_path, series, 128, labels)
    fig = drawn["context_vs_length.png"]
    fig.canvas.draw()
    ax = panels(fig)[0]
    for text in (ax.yaxis.label, ax.xaxis.label, ax.title):
        box = text.get_window_extent()
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1, (
            text.get_text(), box, fig.bbox)


def test_a_sliding_panel_draws_only_the_positions_every_window_scores(mix, tmp_path, drawn):
    records, _ = mix
    sliding = copy.deepcopy(next(r for r in records if r["label"] == "rope"))  # lengths 32, 64
    sliding.update(protocol="sliding", stride=16)
    rows = compare.fold([*records, sliding])
    report([*records, sliding], rows, tmp_path, drawn)
    table = next(r["table"] for r in rows if r["protocol"] == "sliding")
    ax = panels(drawn["loss_vs_position.png"])[table - 1]
    first = 64 - 16 + 1  # 1-based: the first position of the last T − S scored by every window
    xs = [x for line in data_lines(ax) for x in line.get_xdata()]
    assert xs and min(xs) >= first, (min(xs), ax.get_title())
    assert "every window" in ax.get_xlabel() and str(first) in ax.get_xlabel(), ax.get_xlabel()
    same = next(r["table"] for r in rows if r["label"] == "rope" and r["protocol"] == "nonoverlapping")
    whole = [x for line in data_lines(panels(drawn["loss_vs_position.png"])[same - 1]) for x in line.get_xdata()]
    assert min(whole) < 2 and max(whole) == max(xs)  # nonoverlapping at the same lengths: every position


def test_six_flat_rows_are_labelled_at_their_ends_on_an_axis_with_values_to_read(tmp_path, drawn):
    """Six rows between 116 and 119 (ALiBi-like, flat), alone and beside one rising to 470 as sinusoidal does: before,
    the six shared one band told apart only by the legend's colours, and the axis beside the riser read 200, 300 and
    400 only (as docs/ppl_vs_length.png did), none of them near the six."""
    flat = {f"s{i}": 116.0 + 0.6 * i for i in range(6)}
    lengths = [128, 256, 512, 1024, 2048]
    rows = [{"setting": s, "length": n, "ppl": p * (1 + 0.001 * k), "ppl_std": 0.0, "train_length": 128,
             "origin_length": 128} for s, p in flat.items() for k, n in enumerate(lengths)]
    rows += [{"setting": "blow", "length": n, "ppl": 155.0 * 1.32 ** k, "ppl_std": 0.0, "train_length": 128,
              "origin_length": 128} for k, n in enumerate(lengths)]
    labels = {**{s: f"alibi, slopes={i}" for i, s in enumerate(flat)}, "blow": "sinusoidal"}
    for title, table in (("flat", [r for r in rows if r["setting"] != "blow"]), ("all", rows)):
        drawn.clear()
        plots.draw_ppl(tmp_path, [(title, table)], labels)
        fig = drawn["ppl_vs_length.png"]
        fig.canvas.draw()
        ax = panels(fig)[0]
        ends = {t.get_text(): t for t in ax.texts if t.get_text() in labels.values()}
        shown = {labels[s] for s in {r["setting"] for r in table}}
        assert set(ends) == shown, (title, sorted(ends))
        for setting in {r["setting"] for r in table}:
            last = max((r for r in table if r["setting"] == setting), key=lambda r: r["length"])
            assert ends[labels[setting]].xy == pytest.approx((last["length"], last["ppl"])), setting  # joined to its end
        from matplotlib.text import Text

        boxes = {text: Text.get_window_extent(t) for text, t in ends.items()}  # the text's, without its arrow
        assert all(box.x0 >= ax.bbox.x1 for box in boxes.values()), title  # in the margin right of the axes
        assert all(fig.bbox.x0 <= b.x0 and b.x1 <= fig.bbox.x1 and fig.bbox.y0 <= b.y0 and b.y1 <= fig.bbox.y1
                   for b in boxes.values()), title
        names = list(boxes)
        assert not [(a, b) for i, a in enumerate(names) for b in names[i + 1:] if boxes[a].overlaps(boxes[b])], title
        ticks = shown_ticks(ax.yaxis)
        low, high = ax.get_ylim()
        assert len(ticks) >= 4, (title, low, high, [t.get_text() for t in ticks])
        assert all(PLAIN.fullmatch(t.get_text()) for t in ticks), [t.get_text() for t in ticks]
        tick_boxes = [t.get_window_extent() for t in ticks]
        assert not any(a.overlaps(b) for i, a in enumerate(tick_boxes) for b in tick_boxes[i + 1:])
        # the largest stretch of the axis without a labelled value is under half of it (log distance)
        values = sorted([low, *(float(t.get_text()) for t in ticks), high])
        assert max(math.log(b / a) for a, b in zip(values, values[1:])) < 0.5 * math.log(high / low), values


@pytest.mark.parametrize("low, high", [(106.0, 128.0), (100.0, 160.0), (116.0, 474.0), (110.0, 200.0), (12.0, 900.0),
                                       (80.0, 3.0e4), (1.5, 2.0), (0.9, 1.2e6)])
def test_a_perplexity_axis_gets_four_to_eight_round_values(low, high):
    from posbench.report.axes import round_values

    values = round_values(low, high)
    assert 4 <= len(values) <= 8, values
    assert all(low <= v <= high for v in values) and values == sorted(set(values)), values
    mantissas = [v / 10 ** math.floor(math.log10(v)) for v in values]
    assert all(abs(100 * m - round(100 * m)) < 1e-6 for m in mantissas), values  # at most 3 significant digits
    stops = [low, *values, high]
    assert max(math.log(b / a) for a, b in zip(stops, stops[1:])) < 0.5 * math.log(high / low), values


def test_a_loss_panel_says_how_many_tokens_its_points_average(mix, tmp_path, drawn):
    records, rows = mix
    report(records, rows, tmp_path, drawn)
    ax = panels(drawn["loss_vs_position.png"])[0]
    first = next(r for r in records if eval_settings(r) == next(r["eval_settings"] for r in rows
                                                                          if r["table"] == 1))
    longest = max(first["results"], key=lambda r: r["length"])
    edges, windows = longest["nll_by_position"]["position"], longest["windows"]
    widths = [b - a for a, b in zip(edges, [*edges[1:], longest["length"]])]
    label = ax.get_xlabel().replace("\n", " ")
    assert f"averages {windows * min(widths):,} to {windows * max(widths):,} tokens" in label, label
