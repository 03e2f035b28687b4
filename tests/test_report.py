"""``posbench report``: many runs' results → report.md, report.csv and two plots, mean ± std over seeds,
skipped runs named with their reason; bad folders fail with one line; and the report a multirun writes
into its sweep folder when it ends (Hydra callback).
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import scipy.stats
from omegaconf import OmegaConf

from posbench.config import schema as schema
from posbench.config.upgrade import upgrade
from posbench.evaluation.perplexity import position_bins, windows
from posbench.evaluation.results import FORMAT, new_eval_stem, record, write_results
from posbench.report import compare, render
from posbench.report.records import collect
from posbench.schemes import variant_label

OUTPUTS = ["report.md", "report.csv", "ppl_vs_length.png", "loss_vs_position.png"]
LENGTHS = [32, 64, 128]


def cli_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR", "WANDB_DIR")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    return env


def posbench(*args, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posbench", *map(str, args)], cwd=cwd, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def table_rows(text: str) -> list[str]:
    """The row labels of the perplexity (and probe) tables in ``text``: the lines under a ``| |`` header up to the
    first line that is not a table row (the rows' legend tables below them left out)."""
    rows, inside = [], False
    for line in text.splitlines():
        inside = line.startswith("| |") or (inside and line.startswith("|"))
        if inside and line.startswith("| ") and not line.startswith("| |"):
            rows.append(line.split("|")[1].strip())
    return rows


def legend_rows(text: str) -> dict[str, dict[str, str]]:
    """{row label: {setting key: value}} of the legend tables in ``text`` (``| row | `key` | … |``)."""
    out, keys = {}, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| row |"):
            keys = [c.strip("`") for c in cells[1:]]
        elif keys and line.startswith("| "):
            out[cells[0]] = dict(zip(keys, cells[1:]))
        elif not line.startswith("|"):
            keys = None
    return out


# ---- fake runs, written with the code a real run uses ----------------------------------------------


def config(scheme: str, seed: int, seq_len: int = 32, n_layer: int = 2, **eval_settings) -> dict:
    return {"scheme": {"name": scheme, **({"base": 10000.0} if scheme in ("rope", "sinusoidal") else {})},
            "model": {"name": "tiny", "n_layer": n_layer, "n_head": 2, "d_model": 32, "d_ff": 64, "dropout": 0.0},
            "data": {"name": "shakespeare", "vocab_size": 512, "cache_dir": None},
            "train": {"seq_len": seq_len, "batch_size": 4, "steps": 10, "lr": 0.002},
            "eval": {"lengths": [seq_len * 2**k for k in range(3)], "protocol": "nonoverlapping", "stride": None,
                     "split": "validation", "max_tokens": 256, **eval_settings},
            "wandb": {"enabled": False}, "seed": seed}


def fake_ppl(scheme: str, seed: int, length: int, n_layer: int = 2) -> float:
    """A perplexity that differs by scheme, seed, setting and length (with a non-trivial spread)."""
    return (30.0 if scheme == "rope" else 25.0) * (length / 32) ** (0.5 if scheme == "rope" else 0.05) \
        + [0.0, 1.7, -0.9][seed % 3] + 3.1 * (n_layer == 4)


def rows_for(cfg: dict, ppl=None) -> list[dict]:
    """Rows as ``evaluate`` makes them, with a per-position NLL curve; ``ppl(length)`` overrides :func:`fake_ppl`."""
    out = []
    for length in cfg["eval"]["lengths"]:
        p = ppl(length) if ppl else fake_ppl(cfg["scheme"]["name"], cfg["seed"], length, cfg["model"]["n_layer"])
        edges = position_bins(length).tolist()
        out.append({"length": length, "ppl": p, "nll": math.log(p), "tokens": 256, "windows": 256 // length,
                    "nll_by_position": {"position": edges, "nll": [math.log(p) + 1 / (1 + q) for q in edges]}})
    return out


def write_run(folder: Path, cfg: dict, results: bool = True, rows: list[dict] | None = None, **extra) -> Path:
    """A Hydra run folder: .hydra/config.yaml and (when ``results``) results.json / results.csv."""
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(cfg), folder / ".hydra" / "config.yaml")
    if results:
        write_eval(folder, cfg, rows, "results", status="complete", **extra)
    return folder


def write_eval(folder: Path, cfg: dict, rows: list[dict] | None = None, stem: str | None = None, **extra) -> Path:
    """A record of ``cfg`` (its ``eval`` settings) beside the run: ``eval-<protocol>-<split>-<n>.json`` by default."""
    e = cfg["eval"]
    rows = rows if rows is not None else rows_for(cfg)
    rec = record(cfg, rows, variant_label(cfg["scheme"]), split=e["split"], train_tokens=1280,
                 train_seconds=2.5, device="cpu", threads=2, **extra)
    return write_results(folder, rec, stem or new_eval_stem(folder, rec["label"], e["protocol"], e["split"]))


def sections(md: str) -> dict[str, str]:
    """report.md cut at its ``## `` headings: {heading: text}, the part before the first under ""."""
    out, head = {"": ""}, ""
    for line in md.splitlines(keepends=True):
        if line.startswith("## "):
            head = line[3:].strip()
            out[head] = ""
        else:
            out[head] += line
    return out


def md_tables(md: str) -> list[tuple[str, list[str], dict[str, list[str]]]]:
    """(title, header cells, {row label: cells}) of every table in report.md (or the printed tables)."""
    out = []
    for block in md.split("### ")[1:]:
        lines = block.splitlines()
        header = next(line for line in lines if line.startswith("| |"))
        rows = {}
        for line in lines[lines.index(header) + 2:]:
            if not line.startswith("| "):
                break
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
        out.append((lines[0], [c.strip() for c in header.strip().strip("|").split("|")][1:], rows))
    return out


def report_csv(folder: Path) -> list[dict]:
    with open(folder / "report.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def sweep(tmp_path) -> Path:
    """2 schemes × 3 seeds, a run still in progress, a broken results.json, a run at another L."""
    root = tmp_path / "sweep"
    job = 0
    for scheme in ("alibi", "rope"):
        for seed in range(3):
            write_run(root / f"{job}_{scheme}_seed{seed}", config(scheme, seed))
            job += 1
    write_run(root / "6_rope_seed3", config("rope", 3), results=False)  # in progress
    broken = write_run(root / "7_alibi_seed3", config("alibi", 3))
    broken.joinpath("results.json").write_text('{"format": 1, "results": [{"length": 32, "ppl": ')
    write_run(root / "8_rope_seed4", config("rope", 4, seq_len=64))
    return root


# ---- posbench report FOLDER -------------------------------------------------------------------------


def test_report_writes_table_csv_plots_and_names_skipped_runs(sweep, tmp_path):
    proc = ok(posbench("report", sweep, cwd=tmp_path))
    assert "Traceback" not in proc.stdout + proc.stderr
    for f in OUTPUTS:
        assert (sweep / f).is_file() and (sweep / f).stat().st_size > 0, f
    assert is_png(sweep / "ppl_vs_length.png") and is_png(sweep / "loss_vs_position.png")
    assert str(sweep / "report.md") in proc.stdout

    # the table: one row per scheme, a column per length, exp(mean NLL) ± std of the per-seed perplexity
    assert table_rows(proc.stdout) == ["alibi", "rope"], proc.stdout
    md = (sweep / "report.md").read_text()
    assert table_rows(md.split("## Settings held fixed")[0]) == ["alibi", "rope"]
    (title, header, rows), = md_tables(md)
    assert title == "1. nonoverlapping, validation split, max_tokens=256, lengths 32…128", title
    assert header == ["32", "64", "128", "ppl(128)/ppl(32)", "seeds"], header
    nll = {(s, n): [math.log(fake_ppl(s, seed, n)) for seed in range(3)] for s in ("alibi", "rope") for n in LENGTHS}
    for scheme in ("alibi", "rope"):
        for cell, n in zip(rows[scheme], LENGTHS):
            ppl = [fake_ppl(scheme, seed, n) for seed in range(3)]
            assert cell.startswith(f"{math.exp(statistics.fmean(nll[scheme, n])):.2f} ± {statistics.stdev(ppl):.2f}"), cell
        assert rows[scheme][4] == "3"
    assert "standard deviation over seeds of the per-seed perplexity" in md

    # report.csv: the same numbers, computed here from the seeds' NLLs; rope is significantly worse (Welch)
    csv_rows = report_csv(sweep)
    assert [(r["setting"], int(r["length"])) for r in csv_rows] == [(s, n) for s in ("alibi", "rope") for n in LENGTHS]
    for r in csv_rows:
        mine = nll[r["setting"], int(r["length"])]
        assert int(r["seeds"]) == 3
        assert float(r["ppl"]) == pytest.approx(math.exp(statistics.fmean(mine)), rel=1e-12)
        assert float(r["ppl_std"]) == pytest.approx(statistics.stdev(math.exp(v) for v in mine), rel=1e-12)
        assert float(r["nll_mean"]) == pytest.approx(statistics.fmean(mine), rel=1e-12)
        assert float(r["nll_std"]) == pytest.approx(statistics.stdev(mine), rel=1e-12)
        assert (r["protocol"], r["split"], r["scored_split"], r["max_tokens"], r["lengths"]) == \
            ("nonoverlapping", "validation", "validation", "256", "32 64 128")
        if r["setting"] == "alibi":
            assert (r["best"], r["test"], r["p_value"], r["significantly_worse"]) == ("True", "best", "", "False")
        else:
            p = scipy.stats.ttest_ind(mine, nll["alibi", int(r["length"])], equal_var=False).pvalue
            assert (r["best"], r["test"], r["significantly_worse"]) == ("False", "welch", str(p < 0.05))
            assert float(r["p_value"]) == pytest.approx(p, rel=1e-9)

    # the settings held fixed, and each skipped run with its reason
    fixed = md.split("## Settings held fixed")[1].split("## Skipped")[0]
    for key, value in [("train.seq_len", "32"), ("model.name", '"tiny"'), ("model.n_layer", "2"),
                       ("data.name", '"shakespeare"'), ("train.steps", "10")]:
        assert f"`{key}` = {value}" in fixed, fixed
    assert "scheme.name" not in fixed and "`seed`" not in fixed
    # an option of rope only: stated beside rope, not as a global setting
    assert "scheme.base" not in fixed.split("## Scheme settings")[0], fixed
    assert "rope: `scheme.base` = 10000.0" in md.split("## Scheme settings")[1], md
    skipped = md.split("## Skipped")[1]
    lines = {name: next((line for line in skipped.splitlines() if name in line), "") for name in
             ("6_rope_seed3", "7_alibi_seed3", "8_rope_seed4")}
    assert "still running" in lines["6_rope_seed3"], skipped
    assert "broken" in lines["7_alibi_seed3"], skipped
    assert "L=64" in lines["8_rope_seed4"] and "L=32" in lines["8_rope_seed4"], skipped
    assert sum(1 for line in skipped.splitlines() if line.startswith("- ")) == 3, skipped
    assert "seeds [0, 1, 2]" in md


def test_report_rows_per_scheme_and_swept_setting_into_out_dir(tmp_path):
    root, out = tmp_path / "sweep", tmp_path / "elsewhere" / "report"
    job = 0
    for scheme in ("alibi", "rope"):
        for n_layer in (2, 4):
            for seed in range(2):
                write_run(root / f"{job}_{scheme}_seed{seed}", config(scheme, seed, n_layer=n_layer))
                job += 1
    before = sorted(p for p in root.rglob("*"))
    proc = ok(posbench("report", root, "--out", out, cwd=tmp_path))
    assert sorted(p for p in root.rglob("*")) == before, "--out DIR: nothing goes into the run folders"
    assert all((out / f).is_file() for f in OUTPUTS), sorted(os.listdir(out))
    assert str(out / "report.md") in proc.stdout
    expected = [f"{s}, model.n_layer={n}" for s in ("alibi", "rope") for n in (2, 4)]
    assert table_rows(proc.stdout) == expected, proc.stdout
    rows = report_csv(out)
    assert list(dict.fromkeys(r["setting"] for r in rows)) == expected
    for r in rows:
        scheme, n_layer = r["setting"].split(", model.n_layer=")
        ppl = [fake_ppl(scheme, seed, int(r["length"]), int(n_layer)) for seed in range(2)]
        assert float(r["ppl"]) == pytest.approx(math.exp(statistics.fmean(map(math.log, ppl))), rel=1e-12)
        assert float(r["ppl_std"]) == pytest.approx(statistics.stdev(ppl), rel=1e-12)
    fixed = (out / "report.md").read_text().split("## Settings held fixed")[1]
    assert "model.n_layer" not in fixed and "`model.d_model` = 32" in fixed
    assert all(is_png(out / f) for f in OUTPUTS[2:])


@pytest.mark.parametrize("what", ["empty folder", "missing folder"])
def test_report_on_nothing_fails_with_one_line(tmp_path, what):
    folder = tmp_path / "runs"
    if what == "empty folder":
        folder.mkdir()
    out = tmp_path / "out"
    args = [folder] if what == "empty folder" else [folder, "--out", out]
    proc = posbench("report", *args, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert len(lines) == 1 and lines[0].startswith("posbench: error:"), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()
    assert (list(folder.iterdir()) == []) if what == "empty folder" else not folder.exists()


def test_failed_run_is_skipped_as_failed_not_broken(sweep):
    """A run stopped by a non-finite loss writes results.json with status "failed" and no rows
    (posbench/training/loop.py); the report should say it failed (and why), not call its file broken."""
    failed = sweep / "9_rope_seed5"
    write_run(failed, config("rope", 5), results=False)
    message = "non-finite loss at step 3; the last good checkpoint is kept"
    write_results(failed, {"format": FORMAT, "status": "failed", "error": message, "step": 3,
                           "results": [], "config": config("rope", 5)})
    records, skipped = collect([sweep])
    assert len(records) == 6
    line = next(s for s in skipped if "9_rope_seed5" in s)
    assert "failed" in line and "broken" not in line, line
    assert message in line, line


@pytest.mark.parametrize("content", ['{"format": 1, "results": [{"length": 32, "ppl": ', "", "[]", "null", '"text"', "42",
                                     '{"format": 1}', '{"format": 1, "results": []}', '{"format": 1, "results": [{}]}',
                                     '{"format": 99, "results": [{"length": 32, "ppl": 1.0}]}',
                                     '{"format": 1, "results": [{"length": 32, "ppl": 1.0}]}'])
def test_any_broken_results_file_is_skipped_not_a_crash(sweep, content):
    (sweep / "7_alibi_seed3" / "results.json").write_text(content)
    records, skipped = collect([sweep])
    assert len(records) == 6
    line = next(s for s in skipped if "7_alibi_seed3" in s)
    assert "broken" in line, line


# ---- what the report must never hide ------------------------------------------------------------------


def test_a_setting_that_differs_between_schemes_labels_every_row(tmp_path):
    """A rope sweep at n_layer=2 and an alibi sweep at n_layer=3, reported together: n_layer is in every row's
    setting (report.csv) and in the legend table under the table, where the short labels stand for them."""
    root = tmp_path / "runs"
    for seed in range(2):
        write_run(root / f"rope{seed}", config("rope", seed, n_layer=2))
        alibi = config("alibi", seed, n_layer=3)
        alibi["train"]["device"] = "cpu"  # bookkeeping: named, but it labels no row
        write_run(root / f"alibi{seed}", alibi)
    table_text, _, _ = render.write_report([root], root)
    assert table_rows(table_text) == ["alibi", "rope"], table_text
    assert legend_rows(table_text) == {"alibi": {"model.n_layer": "3"}, "rope": {"model.n_layer": "2"}}, table_text
    assert list(dict.fromkeys(r["setting"] for r in report_csv(root))) == ["alibi, model.n_layer=3", "rope, model.n_layer=2"]
    parts = sections((root / "report.md").read_text())
    assert "model.n_layer" not in parts["Settings held fixed"] and "`model.d_model` = 32" in parts["Settings held fixed"]
    differ = next(text for head, text in parts.items() if head.startswith("Settings that differ"))
    assert '`train.device`: "auto", "cpu"' in differ, differ


def test_a_scheme_key_labels_the_rows_of_its_scheme(tmp_path):
    root = tmp_path / "runs"
    for base in (500.0, 10000.0):
        cfg = config("rope", 0)
        cfg["scheme"]["base"] = base
        write_run(root / f"rope{base}", cfg)
    write_run(root / "alibi", config("alibi", 0))
    table_text, _, _ = render.write_report([root], root)
    assert table_rows(table_text) == ["alibi", "rope, scheme.base=500.0", "rope, scheme.base=10000.0"], table_text


def test_a_variant_label_names_its_row_record_and_eval_file(tmp_path):
    """rope re-evaluated with YaRN ×16 is its own row, labelled rope+yarn×16 (not rope, scheme.factor=…), and
    its eval file carries the label."""
    folder = tmp_path / "runs" / "rope"
    cfg = config("rope", 0)
    write_run(folder, cfg)
    yarn = {**cfg, "scheme": {"name": "rope", "base": 10000.0, "scaling": "yarn", "factor": 16.0, "original_length": 32}}
    path = write_eval(folder, yarn)
    assert path.name == "eval-rope+yarnx16-nonoverlapping-validation-1.json"
    assert json.loads(path.read_text())["label"] == "rope+yarn×16"
    table_text, _, _ = render.write_report([tmp_path / "runs"], tmp_path / "out")
    assert table_rows(table_text) == ["rope", "rope+yarn×16"], table_text


def test_eval_stems_are_claimed_exclusively(tmp_path):
    """Eight evaluations naming their files at once get eight different stems, each file created once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        stems = list(pool.map(lambda _: new_eval_stem(tmp_path, "t5", "sliding", "test"), range(8)))
    assert sorted(stems, key=lambda t: int(t.rsplit("-", 1)[1])) == [f"eval-t5-sliding-test-{n}" for n in range(1, 9)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{t}.json" for t in stems)


def test_format_2_records_with_every_scheme_key_report_beside_format_3(tmp_path):
    """Format 2 recorded base and max_positions for every scheme; each scheme keeps only its own and labels
    no row with the others, and a scheme's own key is shown as a setting of that scheme."""
    root = tmp_path / "runs"
    for scheme, table in (("learned", 512), ("rope", None)):
        old = config(scheme, 0)
        old["scheme"] = {"name": scheme, "base": 10000.0, "max_positions": table}
        run = write_run(root / f"{scheme}-old", old)
        rec = json.loads((run / "results.json").read_text())
        (run / "results.json").write_text(json.dumps({**rec, "format": 2}))
    write_run(root / "alibi", config("alibi", 0))  # format 3: no base, no max_positions
    records, skipped = collect([root])
    assert not skipped and [r["config"]["scheme"] for r in records] == [
        {"name": "alibi"}, {"name": "learned", "max_positions": 512},
        {"name": "rope", "base": 10000.0, "scaling": "none", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "original_length": None,
         "yarn_ramp": "reference", "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rotary_fraction": 1.0}]
    table_text, _, _ = render.write_report([root], root)
    assert table_rows(table_text) == ["alibi", "learned", "rope"], table_text
    md = (root / "report.md").read_text()
    assert "`scheme.max_positions` = 512" in md and "`scheme.base` = 10000.0" in md, md


def test_each_evaluation_setting_is_its_own_table_never_one_cell(tmp_path):
    """Re-evaluations with another token budget, other lengths or another split are never averaged with the run."""
    root = tmp_path / "runs"
    evals = {"results": ({}, {}, 0.0), "budget": ({"max_tokens": 128}, {}, 100.0), "lengths": ({"lengths": [32, 64]}, {}, 200.0),
             "test": ({"split": "test"}, {"scored_split": "validation"}, 300.0)}
    for seed in range(2):
        rows = rows_for(config("rope", seed), lambda n: 10 + seed + n / 32)
        run = write_run(root / f"rope{seed}", config("rope", seed), rows=rows)
        for name, (settings, extra, offset) in evals.items():
            if name != "results":
                cfg = config("rope", seed, **settings)
                write_eval(run, cfg, rows_for(cfg, lambda n: offset + 10 + seed + n / 32), **extra)
    table_text, _, _ = render.write_report([root], root)
    tables = md_tables(table_text)
    titles = {title.split(". ", 1)[1]: rows["rope"] for title, _, rows in tables}
    v = "nonoverlapping, validation split, max_tokens="
    expected = {f"{v}256, lengths 32…128": (0.0, LENGTHS), f"{v}128, lengths 32…128": (100.0, LENGTHS),
                f"{v}256, lengths 32, 64": (200.0, [32, 64]),
                "nonoverlapping, test split (scored the validation files: the corpus has no test files), max_tokens=256, "
                "lengths 32…128": (300.0, LENGTHS)}
    assert set(titles) == set(expected), list(titles)
    for title, (offset, lengths) in expected.items():
        cells = titles[title]
        for cell, n in zip(cells, lengths):
            ppl = [offset + 10 + seed + n / 32 for seed in range(2)]
            want = f"{math.exp(statistics.fmean(map(math.log, ppl))):.2f} ± {statistics.stdev(ppl):.2f}"
            assert cell.startswith(want), (title, cell)
    assert all(r["seeds"] == "2" for r in report_csv(root)), "a cell held records of two evaluation settings"


def test_a_duplicate_record_is_skipped_with_its_reason(tmp_path):
    root = tmp_path / "runs"
    run = write_run(root / "rope0", config("rope", 0))
    write_run(root / "alibi0", config("alibi", 0))
    again = write_eval(run, config("rope", 0), rows_for(config("rope", 0), lambda n: 99.0))  # the same settings again
    records, skipped = collect([root])
    assert sorted(r["path"] for r in records) == sorted([str(again), str(root / "alibi0" / "results.json")])
    line = (f"{run / 'results.json'}: older duplicate of {again} (the same setting, seed and evaluation settings); the "
            "newer is reported")
    assert skipped == [line], skipped
    table_text, _, _ = render.write_report([root], root)
    assert md_tables(table_text)[0][2]["rope"][0].startswith("99.00 "), table_text
    assert f"- {line}" in sections((root / "report.md").read_text())["Skipped"]


def test_an_old_record_without_a_new_key_reads_its_default(tmp_path):
    """A format-1 results.json from before ``model.scale_embeddings`` next to records that have the key."""
    root = tmp_path / "runs"
    old_cfg = config("rope", 0)
    old = write_run(root / "old", old_cfg)
    rec = json.loads((old / "results.json").read_text())
    rec["format"] = 1
    assert "scale_embeddings" not in rec["config"]["model"]
    (old / "results.json").write_text(json.dumps(rec))
    was = upgrade(old_cfg, 1)["model"]["scale_embeddings"]  # what the schema says a format-1 run did
    new_cfg = config("rope", 1)
    new_cfg["model"]["scale_embeddings"] = not was
    write_run(root / "new", new_cfg)
    write_run(root / "alibi", config("alibi", 0))  # format 2 without the key: the block's convention
    table_text, _, _ = render.write_report([root], root)
    label = "{}, model.scale_embeddings={}".format
    default = json.dumps(True)  # a GPT-block record without the key: the GPT block's convention, √D
    assert table_rows(table_text) == ["alibi", *(label("rope", json.dumps(v)) for v in sorted([was, not was]))], table_text
    assert legend_rows(table_text)["alibi"] == {"model.scale_embeddings": default}, table_text
    assert report_csv(root)[0]["setting"] == label("alibi", default)


def test_cell_is_exp_mean_nll_and_ratio_is_each_rows_own(tmp_path):
    root = tmp_path / "runs"
    spread = [10.0, 40.0]  # exp(mean log) = 20, the mean of perplexities 25
    for seed in range(2):
        for scheme, grow in (("rope", 0.5), ("alibi", 0.0)):
            cfg = config(scheme, seed, lengths=[16, 32, 64, 128])
            write_run(root / f"{scheme}{seed}", cfg, rows=rows_for(cfg, lambda n: spread[seed] * (n / 32) ** grow))
    table_text, _, _ = render.write_report([root], root)
    (title, header, rows), = md_tables(table_text)
    assert title.endswith("lengths 16…128") and header == ["16", "32", "64", "128", "ppl(128)/ppl(32)", "seeds"], header
    assert rows["rope"][1].startswith(f"{20.0:.2f} ± {statistics.stdev(spread):.2f}"), rows["rope"]
    assert rows["rope"][4] == f"{math.sqrt(128 / 32):.2f}" and rows["alibi"][4] == "1.00", rows


def test_rows_and_seeds_are_ordered_as_numbers(tmp_path):
    root = tmp_path / "runs"
    for n_layer in (10, 2):
        for seed in (10, 2):
            write_run(root / f"l{n_layer}s{seed}", config("rope", seed, n_layer=n_layer))
    table_text, _, _ = render.write_report([root], root)
    assert table_rows(table_text) == ["rope, model.n_layer=2", "rope, model.n_layer=10"], table_text
    assert list(dict.fromkeys(r["setting"] for r in report_csv(root))) == ["rope, model.n_layer=2", "rope, model.n_layer=10"]
    assert "seeds [2, 10]" in (root / "report.md").read_text()


NLL = {"alibi": [3.00, 3.10, 2.95], "sinusoidal": [3.02, 3.12, 2.99], "rope": [3.50, 3.55, 3.60]}


def test_welch_p_value_over_seeds_decides_the_stars(tmp_path):
    root = tmp_path / "runs"
    for scheme, nll in NLL.items():
        for seed, v in enumerate(nll):
            cfg = config(scheme, seed)
            write_run(root / f"{scheme}{seed}", cfg, rows=rows_for(cfg, lambda n: math.exp(v + n / 1000)))
    table_text, _, _ = render.write_report([root], root)
    (_, _, cells), = md_tables(table_text)
    by = {(r["setting"], int(r["length"])): r for r in report_csv(root)}
    for n in LENGTHS:
        best = [v + n / 1000 for v in NLL["alibi"]]
        assert by["alibi", n]["test"] == "best" and cells["alibi"][LENGTHS.index(n)].endswith("★")
        for scheme in ("sinusoidal", "rope"):
            p = scipy.stats.ttest_ind([v + n / 1000 for v in NLL[scheme]], best, equal_var=False).pvalue
            r = by[scheme, n]
            assert r["test"] == "welch" and float(r["p_value"]) == pytest.approx(p, rel=1e-9, abs=1e-12)
            assert r["significantly_worse"] == str(p < 0.05)
            assert cells[scheme][LENGTHS.index(n)].endswith("★") == (p >= 0.05), (scheme, n, p)
        assert (by["sinusoidal", n]["significantly_worse"], by["rope", n]["significantly_worse"]) == ("False", "True")
    assert "Welch's t-test" in table_text and "p < 0.05" in table_text


def bootstrap_ci(a: list[float], b: list[float], tokens: list[int], resamples: int = 10_000) -> tuple[float, float]:
    """Paired bootstrap, written out: the 2.5 and 97.5 percentiles of (Σ a − Σ b) / Σ tokens over resampled windows."""
    import random

    rng, n = random.Random(1), len(tokens)
    stats = sorted((sum(a[i] - b[i] for i in idx) / sum(tokens[i] for i in idx))
                   for idx in ([rng.randrange(n) for _ in range(n)] for _ in range(resamples)))
    return stats[int(0.025 * resamples)], stats[int(0.975 * resamples) - 1]


def window_rows(cfg: dict, per_token) -> list[dict]:
    """Rows with per-window NLL sums: window i of length n has NLL ``per_token(n, i)`` nats per target."""
    e, out = cfg["eval"], []
    for n, row in zip(e["lengths"], rows_for(cfg)):
        tokens = [size - first for _, size, first in windows(e["max_tokens"], n, e["protocol"], e["stride"])]
        nll = [t * per_token(n, i) for i, t in enumerate(tokens)]
        mean = sum(nll) / sum(tokens)
        out.append({**row, "ppl": math.exp(mean), "nll": mean, "window_nll": nll, "window_tokens": tokens})
    return out


def test_single_seed_rows_get_a_paired_bootstrap_over_windows(tmp_path):
    root = tmp_path / "runs"
    base = {"alibi": lambda n, i: 3.0 + 0.4 * math.sin(i),
            "rope": lambda n, i: 3.3 + 0.4 * math.sin(i) + 0.05 * math.cos(i),  # obviously worse
            "sinusoidal": lambda n, i: 3.0 + 0.4 * math.sin(i) + 0.05 * (-1) ** i}  # indistinguishable
    sums = {}
    for scheme, per_token in base.items():
        cfg = config(scheme, 0, protocol="sliding", stride=16)
        rows = window_rows(cfg, per_token)
        sums[scheme] = {r["length"]: r for r in rows}
        write_run(root / scheme, cfg, rows=rows)
    old = config("learned", 0, protocol="sliding", stride=16)  # format 1: no per-window NLL, so no test
    old["model"]["scale_embeddings"] = True
    rec = json.loads(write_run(root / "learned", old, rows=rows_for(old, lambda n: 40.0)).joinpath("results.json").read_text())
    (root / "learned" / "results.json").write_text(json.dumps({**rec, "format": 1}))
    table_text, _, _ = render.write_report([root], root)
    (title, _, cells), = md_tables(table_text)
    assert title.startswith("1. sliding (stride 16), validation split"), title
    by = {(r["setting"], int(r["length"])): r for r in report_csv(root)}
    for k, n in enumerate(LENGTHS):
        best = min(base, key=lambda s: sums[s][n]["nll"])
        assert best in ("alibi", "sinusoidal") and by[best, n]["test"] == "best"
        for scheme in set(base) - {best}:
            a, b = sums[scheme][n], sums[best][n]
            low, high = bootstrap_ci(a["window_nll"], b["window_nll"], a["window_tokens"])
            r = by[scheme, n]
            assert r["test"] == "bootstrap" and r["p_value"] == ""
            width = high - low
            assert float(r["ci_low"]) == pytest.approx(low, abs=0.1 * width)
            assert float(r["ci_high"]) == pytest.approx(high, abs=0.1 * width)
            assert r["significantly_worse"] == str(low > 0) == str(scheme == "rope"), (scheme, n, low, high)
            assert cells[scheme][k].endswith("★") == (scheme != "rope"), cells
        assert by["learned", n]["test"] == "n/a" and cells["learned"][k].endswith("†"), cells["learned"]
    tokens = sums["alibi"][32]["window_tokens"]
    assert f"{len(tokens)} windows at 32" in table_text and "10,000 resamples" in table_text and "95% CI" in table_text


def test_plots_show_the_validation_split_and_the_largest_group(tmp_path, monkeypatch):
    """A test-split re-evaluation (and a smaller validation group) must not switch the plots away from the sweep."""
    import matplotlib.figure

    shown, save = [], matplotlib.figure.Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        ax = fig.axes[0]
        shown.append((Path(path).name, ax.get_title(), {ln.get_label(): list(ln.get_ydata()) for ln in ax.get_lines()}))
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    root = tmp_path / "runs"
    for scheme in ("alibi", "rope"):
        for seed in range(2):
            run = write_run(root / f"{scheme}{seed}", config(scheme, seed))
    write_eval(run, config("rope", 1, split="test"), rows_for(config("rope", 1), lambda n: 500.0))
    write_eval(run, config("rope", 1, max_tokens=128), rows_for(config("rope", 1), lambda n: 600.0))
    _, rows, _ = render.write_report([root], root)

    expected = {s: (LENGTHS, [math.exp(statistics.fmean(math.log(fake_ppl(s, seed, n)) for seed in range(2))) for n in LENGTHS])
                for s in ("alibi", "rope")}
    series = compare.ppl_series(rows)
    assert set(series) == set(expected)
    for s, (xs, ys) in series.items():
        assert list(xs) == LENGTHS and ys == pytest.approx(expected[s][1], rel=1e-12), s
    (ppl_png, ppl_title, ppl_lines), (pos_png, pos_title, pos_lines) = shown
    assert (ppl_png, pos_png) == ("ppl_vs_length.png", "loss_vs_position.png")
    for title in (ppl_title, pos_title):
        assert "nonoverlapping, validation split, max_tokens=256" in title, title
    assert ppl_lines["rope"] == pytest.approx(expected["rope"][1], rel=1e-12)
    first_bin = statistics.fmean(math.log(fake_ppl("rope", seed, 128)) + 1 for seed in range(2))  # position 0: +1/(1+0)
    assert pos_lines["rope (128)"][0] == pytest.approx(first_bin, rel=1e-12)


# ---- the report at the end of a multirun --------------------------------------------------------------


def test_multirun_ends_with_a_report_in_the_sweep_folder(tmp_path_factory):
    cache, sweep, cwd = (tmp_path_factory.mktemp(n) for n in ("report-cache", "report-sweep", "report-cwd"))
    proc = ok(posbench("train", "-m", "debug=fast", "scheme=alibi,rope", "seed=0,1", f"hydra.sweep.dir={sweep}",
                       f"data.cache_dir={cache}", cwd=cwd))
    runs = sorted(p.parent for p in sweep.glob("*/results.json"))
    assert len(runs) == 4, sorted(os.listdir(sweep))
    for f in OUTPUTS:
        assert (sweep / f).is_file(), f"{f} missing from the sweep folder: {sorted(os.listdir(sweep))}"
    assert is_png(sweep / "ppl_vs_length.png") and is_png(sweep / "loss_vs_position.png")
    assert sorted(table_rows(proc.stdout)) == ["alibi", "rope"], proc.stdout
    assert "report.md" in proc.stdout

    with open(sweep / "report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    results = [json.loads((r / "results.json").read_text()) for r in runs]
    for r in rows:
        nll = [row["nll"] for rec in results if rec["scheme"] == r["setting"]
               for row in rec["results"] if row["length"] == int(r["length"])]
        assert len(nll) == int(r["seeds"]) == 2
        assert float(r["ppl"]) == pytest.approx(math.exp(statistics.fmean(nll)), rel=1e-12)
        assert float(r["ppl_std"]) == pytest.approx(statistics.stdev(math.exp(v) for v in nll), rel=1e-12)
        assert r["test"] in ("best", "welch")
    assert {(r["setting"], int(r["length"])) for r in rows} == {(s, n) for s in ("alibi", "rope") for n in (32, 64)}


def test_a_yarn_record_of_format_3_reads_as_the_paper_ramp(tmp_path):
    """Before scheme.yarn_ramp existed (results format 3), posbench's YaRN was the paper's ramp: such a record is
    labelled rope+yarn_paper×16, a row of its own beside today's YaRN (the reference ramp, recorded by format 4)."""
    folder = tmp_path / "runs" / "rope"
    cfg = config("rope", 0)
    write_run(folder, cfg)
    yarn = {"name": "rope", "base": 10000.0, "scaling": "yarn", "factor": 16.0, "original_length": 32}
    old = write_eval(folder, {**cfg, "scheme": yarn})
    (old.with_suffix(".json")).write_text(json.dumps({**json.loads(old.read_text()), "format": 3}))
    write_eval(folder, {**cfg, "scheme": {**yarn, "yarn_ramp": "reference"}})
    records, skipped = collect([tmp_path / "runs"])
    assert not skipped and sorted(r["setting"] for r in records) == ["rope", "rope+yarn_paper×16", "rope+yarn×16"]
    assert [r["config"]["scheme"]["yarn_ramp"] for r in records if r["format"] == 3] == ["paper"]
