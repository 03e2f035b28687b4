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
from omegaconf import OmegaConf

from posbench import report
from posbench.evaluate import position_bins

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
    """The row labels of the markdown tables in ``text`` (header and rule lines left out)."""
    return [line.split("|")[1].strip() for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| |")]


# ---- fake runs, written with the code a real run uses ----------------------------------------------


def config(scheme: str, seed: int, seq_len: int = 32, n_layer: int = 2) -> dict:
    return {"scheme": {"name": scheme, "base": 10000.0, "max_positions": None},
            "model": {"name": "tiny", "n_layer": n_layer, "n_head": 2, "d_model": 32, "d_ff": 64, "dropout": 0.0},
            "data": {"name": "shakespeare", "vocab_size": 512, "cache_dir": None},
            "train": {"seq_len": seq_len, "batch_size": 4, "steps": 10, "lr": 0.002},
            "eval": {"lengths": [seq_len * 2**k for k in range(3)], "protocol": "nonoverlapping", "stride": None,
                     "split": "validation", "max_tokens": 256},
            "wandb": {"enabled": False}, "seed": seed}


def fake_ppl(scheme: str, seed: int, length: int, n_layer: int = 2) -> float:
    """A perplexity that differs by scheme, seed, setting and length (with a non-trivial spread)."""
    return (30.0 if scheme == "rope" else 25.0) * (length / 32) ** (0.5 if scheme == "rope" else 0.05) \
        + [0.0, 1.7, -0.9][seed % 3] + 3.1 * (n_layer == 4)


def rows_for(cfg: dict) -> list[dict]:
    """Rows as ``evaluate`` makes them, with a per-position NLL curve."""
    out = []
    for length in cfg["eval"]["lengths"]:
        ppl = fake_ppl(cfg["scheme"]["name"], cfg["seed"], length, cfg["model"]["n_layer"])
        edges = position_bins(length).tolist()
        out.append({"length": length, "ppl": ppl, "nll": math.log(ppl), "tokens": 256, "windows": 256 // length,
                    "nll_by_position": {"position": edges, "nll": [math.log(ppl) + 1 / (1 + p) for p in edges]}})
    return out


def write_run(folder: Path, cfg: dict, results: bool = True) -> Path:
    """A Hydra run folder: .hydra/config.yaml and (when ``results``) results.json / results.csv."""
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(cfg), folder / ".hydra" / "config.yaml")
    if results:
        rec = report.record(cfg, rows_for(cfg), split="validation", train_tokens=1280, train_seconds=2.5,
                            device="cpu", threads=2, status="complete")
        report.write_results(folder, rec)
    return folder


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

    # the table: one row per scheme, a column per length, mean ± std over the three seeds
    assert sorted(table_rows(proc.stdout)) == ["alibi", "rope"], proc.stdout
    md = (sweep / "report.md").read_text()
    assert sorted(table_rows(md.split("## Settings held fixed")[0])) == ["alibi", "rope"]
    header = next(line for line in md.splitlines() if line.startswith("| |"))
    assert header.startswith("| | 32 | 64 | 128 |"), header
    rope_line = next(line for line in proc.stdout.splitlines() if line.startswith("| rope |"))
    rope = [fake_ppl("rope", s, 32) for s in range(3)]
    assert f"{statistics.fmean(rope):.1f} ± {statistics.stdev(rope):.1f}" in rope_line

    # report.csv: the same numbers, computed here from the seeds' perplexities
    with open(sweep / "report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["setting"], int(r["length"])) for r in rows} == {(s, n) for s in ("alibi", "rope") for n in LENGTHS}
    for r in rows:
        ppl = [fake_ppl(r["setting"], seed, int(r["length"])) for seed in range(3)]
        assert int(r["seeds"]) == 3
        assert float(r["ppl_mean"]) == pytest.approx(statistics.fmean(ppl), rel=1e-12)
        assert float(r["ppl_std"]) == pytest.approx(statistics.stdev(ppl), rel=1e-12)
        assert r["protocol"] == "nonoverlapping" and r["split"] == "validation"

    # the settings held fixed, and each skipped run with its reason
    fixed = md.split("## Settings held fixed")[1].split("## Skipped")[0]
    for key, value in [("train.seq_len", "32"), ("model.name", '"tiny"'), ("model.n_layer", "2"),
                       ("data.name", '"shakespeare"'), ("train.steps", "10")]:
        assert f"`{key}` = {value}" in fixed, fixed
    assert "scheme.name" not in fixed and "`seed`" not in fixed
    skipped = md.split("## Skipped")[1]
    lines = {name: next((l for l in skipped.splitlines() if name in l), "") for name in
             ("6_rope_seed3", "7_alibi_seed3", "8_rope_seed4")}
    assert "still running" in lines["6_rope_seed3"], skipped
    assert "broken" in lines["7_alibi_seed3"], skipped
    assert "L=64" in lines["8_rope_seed4"] and "L=32" in lines["8_rope_seed4"], skipped
    assert sum(1 for l in skipped.splitlines() if l.startswith("- ")) == 3, skipped
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
    root = out  # the report's files
    expected = [f"{s}, model.n_layer={n}" for s in ("alibi", "rope") for n in (2, 4)]
    assert sorted(table_rows(proc.stdout)) == expected, proc.stdout
    with open(root / "report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted({r["setting"] for r in rows}) == expected
    for r in rows:
        scheme, n_layer = r["setting"].split(", model.n_layer=")
        ppl = [fake_ppl(scheme, seed, int(r["length"]), int(n_layer)) for seed in range(2)]
        assert float(r["ppl_mean"]) == pytest.approx(statistics.fmean(ppl), rel=1e-12)
        assert float(r["ppl_std"]) == pytest.approx(statistics.stdev(ppl), rel=1e-12)
    fixed = (root / "report.md").read_text().split("## Settings held fixed")[1]
    assert "model.n_layer" not in fixed and "`model.d_model` = 32" in fixed
    assert all(is_png(root / f) for f in OUTPUTS[2:])


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
    (posbench/train.py); the report should say it failed (and why), not call its file broken."""
    failed = sweep / "9_rope_seed5"
    write_run(failed, config("rope", 5), results=False)
    message = "non-finite loss at step 3; the last good checkpoint is kept"
    report.write_results(failed, {"format": report.FORMAT, "status": "failed", "error": message, "step": 3,
                                  "results": [], "config": config("rope", 5)})
    records, skipped = report.collect([sweep])
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
    records, skipped = report.collect([sweep])
    assert len(records) == 6
    line = next(s for s in skipped if "7_alibi_seed3" in s)
    assert "broken" in line, line


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
        ppl = [row["ppl"] for rec in results if rec["scheme"] == r["setting"]
               for row in rec["results"] if row["length"] == int(r["length"])]
        assert len(ppl) == int(r["seeds"]) == 2
        assert float(r["ppl_mean"]) == pytest.approx(statistics.fmean(ppl), rel=1e-12)
        assert float(r["ppl_std"]) == pytest.approx(statistics.stdev(ppl), rel=1e-12)
    assert {(r["setting"], int(r["length"])) for r in rows} == {(s, n) for s in ("alibi", "rope") for n in (32, 64)}
