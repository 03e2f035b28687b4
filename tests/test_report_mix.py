"""``posbench report`` over runs that differ in more than the scheme (issue 28 items 1–3): a fine-tuned line, a probed
run, a re-evaluation with YaRN and a small sweep (tests/fixtures/report_mix, made with the real CLI: its README).

* plots: a panel per evaluation setting, legends of short labels below the axes, titles that do not overlap, no
  warning on the terminal;
* rows: short labels, and under each table a legend table of the settings that differ; report.csv keeps the full
  setting and adds the label;
* ★: each table names its columns' reference and the test; a cell whose verdict its printed number does not tell
  (equal numbers, or an order the stars reverse) gets a numbered footnote with the test's statistic.
"""

from __future__ import annotations

import csv
import math
import re
import warnings
from pathlib import Path

import pytest

from posbench.evaluation import stats
from posbench.report import compare, render
from posbench.report.records import _mark_reevaluations, collect
from posbench.report.settings import LABEL_WIDTH, label_of, short_labels
from test_report import config, legend_rows, md_tables, ok, posbench, report_csv, table_rows, window_rows, write_run

MIX = Path(__file__).parent / "fixtures" / "report_mix"
TABLES = ["nonoverlapping, validation split, max_tokens=256, lengths 128…4096",
          "nonoverlapping, validation split, max_tokens=256, lengths 32, 64",
          "nonoverlapping, validation split, max_tokens=512, lengths 32…512"]
LABELS = ["alibi, data.passkey_rate=0.0", "alibi, data.passkey_rate=0.1", "alibi+rand2048", "rope", "rope+rand2048",
          "rope ft128×0", "rope ft128×50", "rope ft512×0", "rope ft512×50", "rope+yarn×4 ft512×50", "rope (yarn×4 at eval)"]


@pytest.fixture(scope="module")
def mix_report(tmp_path_factory):
    """(stdout, stderr, out folder) of ``posbench report tests/fixtures/report_mix --out …``, run once."""
    out = tmp_path_factory.mktemp("mix") / "report"
    proc = ok(posbench("report", MIX, "--out", out, cwd=out.parent))
    return proc.stdout, proc.stderr, out


# ---- through the CLI ---------------------------------------------------------------------------------------------


def test_cli_plots_every_setting_without_a_warning(mix_report):
    _, stderr, out = mix_report
    assert stderr == "", stderr  # no matplotlib (or scipy) warning reaches the terminal
    md = (out / "report.md").read_text()
    assert [title.split(". ", 1)[1] for title, _, _ in md_tables(md)[:3]] == TABLES
    for name in ("ppl_vs_length", "loss_vs_position", "ppl_vs_finetune", "passkey_vs_distance", "passkey_heatmap"):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG", name
    assert "a panel per table" in md and "(table P1)" in md


def test_cli_rows_are_short_labels_with_a_legend_table(mix_report):
    stdout, _, out = mix_report
    assert sorted(set(table_rows(stdout))) == sorted(LABELS), stdout
    assert all(len(label) <= LABEL_WIDTH for label in table_rows(stdout))
    legend = legend_rows(stdout)
    assert legend["rope ft128×0"] == {"train.batch_size": "16", "train.seq_len": "128", "train.steps": "0"}, legend
    assert legend["alibi, data.passkey_rate=0.1"] == {"data.passkey_rate": "0.1"}, legend
    assert ("The rows of this table share `data.passkey_rate` = 0.0, `init_from` = rope, `train.lr` = 0.0005"
            in stdout), stdout
    rows = report_csv(out)
    by_label = {r["label"]: r["setting"] for r in rows}
    assert sorted(by_label) == sorted(LABELS)
    assert by_label["rope ft128×0"] == ("rope ft128×0, data.passkey_rate=0.0, init_from=rope, train.batch_size=16, "
                                        "train.lr=0.0005, train.schedule=constant, train.weight_decay=0.0")
    assert {"setting", "ppl", "test", "p_value", "significantly_worse", "label", "reference", "windows"} <= set(rows[0])
    with open(out / "passkey.csv", newline="") as f:
        assert {r["label"] for r in csv.DictReader(f)} == {"alibi, data.passkey_rate=0.1", "rope (yarn×4 at eval)"}


def test_cli_names_each_columns_reference_and_test(mix_report):
    stdout, _, out = mix_report
    rows = report_csv(out)
    for r in rows:  # every cell names the row it was tested against: its column's lowest mean NLL
        column = [c for c in rows if (c["table"], c["length"]) == (r["table"], r["length"])]
        assert r["reference"] == min(column, key=lambda c: float(c["nll_mean"]))["setting"]
    notes = [line for line in stdout.splitlines() if line.startswith("★: in each column")]
    assert len(notes) == 2, stdout  # table 3 has one row: nothing compared
    assert "(rope ft128×50 at every length)" in notes[0] and "(alibi, data.passkey_rate=0.0 at every length)" in notes[1]
    assert all("two-sided level 0.05" in n and "paired bootstrap over evaluation windows" in n for n in notes)
    assert f"fewer than {stats.MIN_WINDOWS} windows" in notes[0]  # 4096: one window, 1024: four; † there
    for _, header, cells in md_tables(stdout)[:2]:  # equal printed numbers, equal marks (or a footnote says why)
        for k in range(len(header) - 3):
            shown = [re.match(r"([\d.]+)(.*)", row[k]).groups() for row in cells.values() if row[k]]
            for a, b in ((a, b) for a in shown for b in shown if a[0] == b[0]):
                assert a[1] == b[1] or re.search("[¹²³⁴⁵⁶⁷⁸⁹]", a[1] + b[1]), (a, b)


# ---- in process ------------------------------------------------------------------------------------------------------


def _extent(artist, renderer):
    return artist.get_window_extent(renderer)


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.filterwarnings("error")
def test_plots_keep_legends_off_the_axes_and_titles_apart(tmp_path, monkeypatch):
    import matplotlib.figure

    drawn, save = {}, matplotlib.figure.Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        save(fig, path, *args, **kwargs)
        renderer = fig.canvas.get_renderer()
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
        titles = [t for t in [fig._suptitle, *(ax.title for ax in fig.axes)] if t is not None and t.get_text()]
        drawn[Path(path).stem] = {
            "figure": fig.bbox, "axes": [_extent(ax, renderer) for ax in fig.axes], "titles": [t.get_text() for t in titles],
            "title_boxes": [_extent(t, renderer) for t in titles],
            "entries": [t.get_text() for legend in legends for t in legend.get_texts()],
            "legend_boxes": [_extent(legend, renderer) for legend in legends]}

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Tight layout not applied" and the like fail the test
        render.write_report([MIX], tmp_path)
    assert set(drawn) == {"ppl_vs_length", "loss_vs_position", "ppl_vs_finetune", "passkey_vs_distance", "passkey_heatmap"}
    for name, fig in drawn.items():
        inside = fig["figure"]
        for box in fig["legend_boxes"] + fig["title_boxes"]:
            assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, name
        for legend in fig["legend_boxes"]:
            assert not any(_overlap(legend, ax) for ax in fig["axes"]), f"{name}: a legend covers an axes"
        boxes = fig["title_boxes"]
        assert not any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), (name, fig["titles"])
        assert all(len(entry) <= LABEL_WIDTH for entry in fig["entries"]), (name, fig["entries"])
    assert set(LABELS) <= set(drawn["ppl_vs_length"]["entries"])  # every row named in the legend
    assert [t.split(". ", 1)[1].replace("\n", " ") for t in drawn["ppl_vs_length"]["titles"][1:]] == TABLES
    assert [t.replace("\n", " ") for t in drawn["passkey_heatmap"]["titles"][1:]] == ["alibi, data.passkey_rate=0.1",
                                                                                      "rope (yarn×4 at eval)"]


def test_a_verdict_the_numbers_do_not_tell_gets_a_footnote(tmp_path):
    """In one column: alibi (2 seeds) the reference; sinusoidal (1 seed) the same to two decimals but higher by 1e-6
    nats in every window: significantly worse by the paired bootstrap; rope (2 seeds) higher, with a spread over
    seeds: not significantly worse by Welch's test. Both get a footnote with their test's statistic."""
    per_token = {"alibi": [lambda n, i: 3.0 + 0.4 * math.sin(i) - 0.001, lambda n, i: 3.0 + 0.4 * math.sin(i) + 0.001],
                 "rope": [lambda n, i: 2.9 + 0.4 * math.sin(i), lambda n, i: 3.2 + 0.4 * math.sin(i)],
                 "sinusoidal": [lambda n, i: 3.0 + 0.4 * math.sin(i) + 1e-6]}
    for scheme, seeds in per_token.items():
        for seed, f in enumerate(seeds):
            cfg = config(scheme, seed, protocol="sliding", stride=16)
            write_run(tmp_path / f"{scheme}{seed}", cfg, rows=window_rows(cfg, f))
    records, _ = collect([tmp_path])
    rows = compare.fold(records)
    text = render.tables(rows, 32)
    (_, _, cells), = md_tables(text)
    by = {(r["setting"], r["length"]): r for r in rows}
    for k, n in enumerate((32, 64, 128)):
        assert by["alibi", n]["best"] and by["sinusoidal", n]["test"] == "bootstrap" and by["rope", n]["test"] == "welch"
        assert cells["alibi"][k].split(" ")[0] == cells["sinusoidal"][k].split(" ")[0]  # equal to two decimals
        assert by["sinusoidal", n]["significantly_worse"] and not by["rope", n]["significantly_worse"]
        assert "★" not in cells["sinusoidal"][k] and re.search("[¹²³⁴⁵⁶⁷⁸⁹]$", cells["sinusoidal"][k]), cells
        assert "★" in cells["rope"][k] and re.search("[¹²³⁴⁵⁶⁷⁸⁹]$", cells["rope"][k]), cells
    notes = [line for line in text.splitlines() if line.startswith("- ")]
    assert len(notes) == 6, text
    sinus = next(line for line in notes if line.split(" ", 2)[2].startswith("sinusoidal at 32 "))
    assert "no ★: significantly worse than the reference alibi" in sinus and "paired bootstrap over 15 windows" in sinus
    assert "CI [+1e-06, +1e-06] nats/token" in sinus, sinus
    rope = next(line for line in notes if line.split(" ", 2)[2].startswith("rope at 32 "))
    assert "★: not significantly worse than the reference alibi" in rope and "Welch's t-test over 2 seeds: p = " in rope
    assert "(alibi at every length)" in text and "Welch's t-test" in text and "paired bootstrap" in text


def test_seeds_equal_to_round_off_give_welch_p_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # scipy's "Precision loss occurred in moment calculation" must not reach a terminal
        p = stats.welch_p([3.0, 3.0, 3.0], [3.1, 3.2])
    assert 0 < p < 1


def test_too_few_windows_is_no_test():
    """A paired bootstrap over 2 windows whose differences share a sign has a 95% interval above 0; with fewer than
    MIN_WINDOWS windows no test over windows can reach the level, and none is made (†)."""
    row = {"nlls": [3.1], "window_runs": [([10.0, 20.0], [4, 4])]}
    best = {"nlls": [3.0], "window_runs": [([9.0, 19.0], [4, 4])]}
    assert stats.paired_bootstrap([10.0, 20.0], [9.0, 19.0], [4, 4])[0] > 0
    out = stats.compare(row, best)
    assert (out["test"], out["significantly_worse"], out["windows"]) == ("n/a", False, 2)
    assert "fewer than 6" in stats.reason(out) and stats.MIN_WINDOWS == 6 and 2 * 0.5 ** 6 < stats.ALPHA < 2 * 0.5 ** 5


def test_the_fixture_holds_records_only():
    files = [p for p in MIX.rglob("*") if p.is_file()]  # no checkpoint, no report of its own
    assert {p.suffix for p in files} == {".json", ".md"} and sum(p.stat().st_size for p in files) < 200_000


def test_report_text_lists_no_unused_option_and_each_scheme_setting_once(mix_report):
    """Issue 39 item 8: no run here ran the context probe, copied, or trained with PoSE or QK-norm, so none of those
    options is listed; the passkey probe's options and the needles' pairs are held fixed over the runs that use them
    (the probed runs, the run trained with needles) and say so; YaRN's options are listed for the YaRN rows only, and
    Llama 3's for none; the rows' scheme settings come as one line per distinct set (2 here: RoPE as it is, and
    with YaRN ×4)."""
    _, _, out = mix_report
    md = (out / "report.md").read_text()
    for key in ("eval.context.", "data.copy_until", "model.qk_norm_layers", "train.pose_chunks", "scheme.low_freq_factor"):
        assert f"`{key}" not in md, key
    fixed = md.split("## Settings held fixed")[1].split("## ")[0]
    assert "- `data.passkey_pairs` = 1 (the runs that use it)\n" in fixed, fixed
    assert "- `eval.passkey.trials` = 4 (the runs that use it)\n" in fixed, fixed  # the unprobed run's 20 is not used
    assert "- `data.copy_rate` = 0.0\n" in fixed, fixed  # every run uses it: no note
    schemes = md.split("## Scheme settings")[1].split("## ")[0].strip().splitlines()
    assert len(schemes) == 2, schemes
    assert schemes[0].startswith("- rope ft512×0, ") and "beta_fast" not in schemes[0] and "yarn_ramp" not in schemes[0]
    assert schemes[1].startswith("- rope+yarn×4 ft512×50, rope (yarn×4 at eval): `scheme.base` = 10000.0, "
                                 "`scheme.beta_fast` = 32.0"), schemes
    assert "Every row here has" not in md and "(settings that differ between the reported runs)" not in md


def test_a_reevaluation_names_the_run_it_was_applied_to():
    """Issue 39 item 8: ``posbench eval`` of a run with other scheme options is labelled by that run's label and what
    the options add (``rope (yarn×4 at eval)``), or the whole new variant where it does not extend the trained one."""
    def label(trained: dict, new: dict) -> str:
        run = [{"path": "r/results.json", "config": {"scheme": trained, "train": {}}},
               {"path": "r/eval-x.json", "config": {"scheme": new, "train": {}}, "scheme_overrides": {"factor": 1}}]
        _mark_reevaluations(run)
        return label_of(run[1])

    rope, yarn2 = {"name": "rope"}, {"name": "rope", "scaling": "yarn", "factor": 2.0}
    assert label(rope, {**yarn2, "factor": 4.0}) == "rope (yarn×4 at eval)"
    assert label(yarn2, {**yarn2, "factor": 2.5}) == "rope+yarn×2 (rope+yarn×2.5 at eval)"
    assert label(yarn2, rope) == "rope+yarn×2 (rope at eval)"


def test_rows_sharing_a_run_label_are_told_apart_by_their_values_never_by_number():
    """Issue 39 item 8: rows that share a run label are labelled with the values of the fewest settings that tell them
    apart (a sweep over lr × batch size: both; over lr with a long list beside it: lr only), keys shortened to their
    last name, then values cut, only as far as needed to fit LABEL_WIDTH with the labels still distinct."""
    def labels(rows):
        records = [{"order": (i,), "setting": f"s{i}", "differs": d, "config": {"scheme": {"name": "rope"}, "train": {}},
                    "path": f"r{i}"} for i, d in enumerate(rows)]
        short_labels(records)
        return [r["label"] for r in records]

    grid = [{"train.lr": lr, "train.batch_size": b, "data.name": "shakespeare"} for lr in ("0.001", "0.002") for b in ("8", "16")]
    assert labels(grid) == ["rope, lr=0.001, batch_size=8", "rope, lr=0.001, batch_size=16",  # full keys: 41 characters
                            "rope, lr=0.002, batch_size=8", "rope, lr=0.002, batch_size=16"]
    lr_only = [{"train.lr": lr, "data.validation": v} for lr, v in (("0.001", '["hamlet"]'), ("0.002", '["macbeth", "lear"]'))]
    assert labels(lr_only) == ["rope, train.lr=0.001", "rope, train.lr=0.002"]  # one value tells them apart
    plays = [{"data.validation": f'["{play}", "the-tempest", "twelfth-night"]'} for play in ("hamlet", "macbeth")]
    assert labels(plays) == ['rope, validation=["hamlet"…', 'rope, validation=["macbeth…']
    same_start = [{"data.validation": f'["hamlet", "the-tempest", "act-{i}"]'} for i in (1, 2)]  # cut: the same
    assert labels(same_start) == [f'rope, data.validation=["hamlet", "the-tempest", "act-{i}"]' for i in (1, 2)]
