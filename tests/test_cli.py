"""The ``posbench train`` command: a tiny end-to-end run, and bad inputs that must stop with one line on stderr,
exit status 2, no traceback, and nothing created or touched in an existing run folder.

Bad inputs are checked in this process (conftest's ``posbench_here``: the CLI's ``main`` up to where Hydra would
start the job); a subprocess checks one of each kind (a bad value, a composition error, unusable data, a sweep) for
what only a real process shows. Every command carries ``debug=fast`` so that a bad input the CLI fails to reject
costs a few seconds of training, not the full default run.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

from helpers import PREFIX, refused, snapshot
from posbench.schemes import SCHEMES

# ---- a good run -----------------------------------------------------------------------------------


def test_debug_fast_run_writes_results_and_checkpoint(trained_run):
    rec = json.loads((trained_run / "results.json").read_text())
    lengths = [r["length"] for r in rec["results"]]
    assert lengths == [32, 64] == rec["lengths"]  # debug=fast evaluates at 32 and 64
    for row in rec["results"]:
        assert math.isfinite(row["ppl"]) and row["ppl"] > 1, row
        assert math.isfinite(row["nll"]) and row["ppl"] == pytest.approx(math.exp(row["nll"]), rel=1e-6)
        assert row["tokens"] == rec["results"][0]["tokens"] > 0  # the same span at every length
    assert rec["scheme"] == "rope" and rec["train_length"] == 32 and rec["protocol"] == "nonoverlapping"
    with open(trained_run / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["length"]) for r in rows] == lengths
    for r, row in zip(rows, rec["results"]):
        assert float(r["ppl"]) == pytest.approx(row["ppl"], rel=1e-6)
    assert (trained_run / "checkpoint.pt").stat().st_size > 0


def test_checkpoint_reproduces_reported_perplexity(trained_run):
    """Rebuilding the model from checkpoint.pt and scoring the same split gives the reported numbers."""
    from posbench.data import cache
    from posbench.evaluation.perplexity import evaluate
    from posbench.model import build
    from posbench.training import checkpoint

    state = checkpoint.read(trained_run / "checkpoint.pt")
    model = build.model_from(state)
    rec = json.loads((trained_run / "results.json").read_text())
    corpus = cache.load_cached(Path(state["tokenizer"]["path"]).parent)
    e = state["config"]["eval"]
    rows = evaluate(model, corpus.tokens[e["split"]], list(e["lengths"]), e["protocol"], e["stride"],
                    e["max_tokens"], e["batch_tokens"])
    for got, reported in zip(rows, rec["results"]):
        assert got["tokens"] == reported["tokens"]
        assert got["ppl"] == pytest.approx(reported["ppl"], rel=1e-4)


# ---- bad inputs -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    """Tiny text files: a split far shorter than debug=fast's longest evaluation length (64 tokens)."""
    root = tmp_path_factory.mktemp("text-data")
    (root / "train.txt").write_text("the cat sat on the mat and the dog sat on the log\n" * 20)
    (root / "valid.txt").write_text("a cat sat.\n")
    (root / "empty.txt").write_text("")
    return root


def choices(*names):
    return lambda msg: all(n in msg for n in names)


BAD = {
    # id: (overrides, check of the message after "posbench: error: ")
    "unknown-scheme": (["scheme=noscheme"], lambda m: "'noscheme'" in m and "scheme" in m and all(n in m for n in SCHEMES)),
    "unknown-model": (["model=huge"], lambda m: "'huge'" in m and "model" in m and choices("tiny", "small", "base")(m)),
    "unknown-data": (["data=wiki"], lambda m: "'wiki'" in m and "data" in m and choices("shakespeare", "text")(m)),
    "unknown-key": (["train.seqlen=64"], lambda m: "unknown config key 'train.seqlen'" in m),
    "unknown-key-added": (["+train.seqlen=64"], lambda m: "unknown config key 'train.seqlen'" in m),
    "unknown-top-key": (["sead=1"], lambda m: "unknown config key 'sead'" in m),
    "non-numeric-seq-len": (["train.seq_len=abc"], lambda m: "train.seq_len" in m and "abc" in m),
    "zero-seq-len": (["train.seq_len=0"], lambda m: "train.seq_len=0" in m and "positive" in m),
    "negative-seq-len": (["train.seq_len=-8"], lambda m: "train.seq_len=-8" in m and "positive" in m),
    "empty-lengths": (["eval.lengths=[]"], lambda m: "eval.lengths" in m and "empty" in m),
    "length-below-2": (["eval.lengths=[1,32]"], lambda m: re.search(r"\b1\b", m) and "eval.lengths" in m and ">= 2" in m),
    "option-the-scheme-lacks": (["scheme=rope", "scheme.max_positions=64"],
                                lambda m: "scheme.max_positions" in m and "rope" in m and "base" in m),
    "learned-table-too-small": (["scheme=learned", "scheme.max_positions=64", "eval.lengths=[32,64,128]"],
                                lambda m: "max_positions=64" in m and "128" in m),
    "heads-do-not-divide": (["model.n_head=3"], lambda m: "model.n_head=3" in m and "d_model=128" in m),
    "split-shorter-than-length": (["eval.lengths=[32,1000000]"],
                                  lambda m: re.search(r"validation split has \d+ tokens", m) and "1000000" in m),
}


def bad_text(text_data, split_file="valid.txt", train_file="train.txt"):
    return ["data=text", f"data.train_files=[{text_data / train_file}]", f"data.validation_files=[{text_data / split_file}]"]


TEXT_BAD = {
    "text-split-too-short": ({}, lambda m, d: re.search(r"validation split has (\d+) tokens", m)
                             and int(re.search(r"has (\d+) tokens", m).group(1)) < 64 and "64" in m),
    "text-missing-file": ({"split_file": "missing.txt"}, lambda m, d: str(d / "missing.txt") in m and "does not exist" in m),
    "text-empty-file": ({"train_file": "empty.txt"}, lambda m, d: str(d / "empty.txt") in m and "empty" in m),
}


def check_rejected(proc, check, before, run_dir):
    refused(proc, run_dir, before)  # exit 2, no traceback, one line "posbench: error: ...", the folder untouched
    message = proc.stderr.strip().splitlines()[0][len(PREFIX):]
    assert check(message), f"unexpected message: {message!r}"


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_exit_2_and_leaves_run_folder_alone(case, posbench_here, trained_run, data_cache):
    overrides, check = BAD[case]
    before = snapshot(trained_run)
    proc = posbench_here("train", "debug=fast", *overrides, f"hydra.run.dir={trained_run}", f"data.cache_dir={data_cache}")
    check_rejected(proc, check, before, trained_run)


@pytest.mark.parametrize("case", list(TEXT_BAD))
def test_bad_text_data_is_one_line_exit_2_and_leaves_run_folder_alone(case, posbench_here, trained_run, data_cache,
                                                                       text_data):
    options, check = TEXT_BAD[case]
    before = snapshot(trained_run)
    proc = posbench_here("train", "debug=fast", *bad_text(text_data, **options), f"hydra.run.dir={trained_run}",
                         f"data.cache_dir={data_cache}")
    check_rejected(proc, lambda m: check(m, text_data), before, trained_run)


@pytest.mark.parametrize("kind", ["config-error", "composition-error", "data-error"])
def test_bad_input_creates_no_run_folder(kind, run_cli, data_cache, text_data, tmp_path):
    """In a real process, one bad input of each kind: a value the checks refuse, a key Hydra cannot compose, data
    that cannot be read. Nothing but the line on stderr, and no run folder made."""
    overrides = {"config-error": ["model.n_head=3"], "composition-error": ["train.seqlen=64"],
                 "data-error": bad_text(text_data, split_file="missing.txt")}[kind]
    run_dir = tmp_path / "never"
    proc = run_cli("train", "debug=fast", *overrides, f"hydra.run.dir={run_dir}", f"data.cache_dir={data_cache}")
    assert proc.returncode == 2, proc.stderr
    assert not run_dir.exists(), f"a failed start left {sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob('*'))}"
    check = {"config-error": BAD["heads-do-not-divide"][1], "composition-error": BAD["unknown-key"][1],
             "data-error": lambda m: TEXT_BAD["text-missing-file"][1](m, text_data)}[kind]
    check_rejected(proc, check, {}, run_dir)


def test_sweep_with_one_bad_job_starts_nothing(run_cli, data_cache, tmp_path):
    """-m: every job is checked before the first starts (the learned job's table, 16·L = 512 rows, is too small)."""
    sweep = tmp_path / "sweep"
    proc = run_cli("train", "-m", "debug=fast", "scheme=rope,learned", "eval.lengths=[32,1024]",
                   f"hydra.sweep.dir={sweep}", f"data.cache_dir={data_cache}")
    assert proc.returncode == 2 and "scheme.max_positions=512" in proc.stderr and "1024" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not sweep.exists()


def test_unknown_command_and_help(posbench_here):
    proc = posbench_here("trian")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "'trian'" in proc.stderr and "train" in proc.stderr
    proc = posbench_here("--help")
    assert proc.returncode == 0 and "train" in proc.stdout


def test_cfg_job_prints_composed_config(run_cli):
    proc = run_cli("train", "scheme=alibi", "model=small", "train.seq_len=64", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"scheme:\s*\n\s+name: alibi", proc.stdout)
    assert re.search(r"model:\s*\n\s+name: small", proc.stdout)
    assert "seq_len: 64" in proc.stdout


def test_multirun_with_cfg_is_one_line_not_hydras_traceback(posbench_here, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = posbench_here("train", "-m", "debug=fast", "--cfg", "job")
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert "--cfg" in line and "-m" in line and "posbench train <overrides> --cfg job" in line
    assert list(tmp_path.iterdir()) == []


def test_report_out_that_is_a_file_is_refused(posbench_here, trained_run, tmp_path):
    out = tmp_path / "report.md"
    out.write_text("mine\n")
    proc = posbench_here("report", trained_run, "--out", out)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert str(out) in line and "--out" in line and out.read_text() == "mine\n"
