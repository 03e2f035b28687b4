"""Results a reader can read (issue 28, items 5 and 7), through the real CLI: the passkey probe's accuracy in the
terminal and in ``results.csv``; Ctrl-C during ``posbench eval`` says how to evaluate again; ``posbench eval``'s
and the curriculum's bad values refused with posbench's one line (the contract of test_refusals.py); eval file
names without spaces.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import CLI_TIMEOUT_S, cli_env
from helpers import ctrl_c_as_in_a_terminal, refused, run_into, snapshot, wilson

PROBE = ["eval.probes=[passkey]", "eval.passkey.trials=2", "eval.passkey.depths=[0,1]"]


def csv_rows(path) -> dict[int, dict]:
    with open(path, newline="") as f:
        return {int(r["length"]): r for r in csv.DictReader(f)}


def probe_line(stdout: str, length: int) -> str:
    """The passkey table's line of ``length`` (the table after the ``passkey retrieval`` heading)."""
    table = stdout[stdout.index("passkey retrieval"):]
    return next(line for line in table.splitlines() if line.split()[:1] == [str(length)])


# ---- item 5: passkey accuracy in the terminal and in results.csv -------------------------------------------------


def test_passkey_accuracy_is_printed_after_the_perplexity_table_and_written_to_results_csv(run_cli, data_cache,
                                                                                             tmp_path):
    run = tmp_path / "run"
    proc = run_into(run_cli, data_cache, run, *PROBE, "eval.passkey.lengths=[32,48]")  # 48: probed, not scored
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = json.loads((run / "results.json").read_text())
    assert proc.stdout.index("ppl/ppl(L)") < proc.stdout.index("passkey retrieval")
    rows = csv_rows(run / "results.csv")
    assert sorted(rows) == [32, 48, 64]
    for length in (32, 48):
        outcomes = [t["correct"] for t in rec["passkey"]["trials"] if t["length"] == length]
        k, n = sum(outcomes), len(outcomes)
        low, high = wilson(k, n)
        assert n == 4
        assert probe_line(proc.stdout, length).split()[:6] == [
            str(length), str(n), str(k), f"{k / n:.0%}", f"[{low:.0%},", f"{high:.0%}]"]
        r = rows[length]
        assert (int(r["passkey_trials"]), int(r["passkey_correct"])) == (n, k)
        assert float(r["passkey_accuracy"]) == pytest.approx(k / n)
        assert (float(r["passkey_ci_low"]), float(r["passkey_ci_high"])) == pytest.approx((low, high), abs=1e-9)
    assert f"within L=32: {float(rows[32]['passkey_accuracy']):.0%} (threshold 80%)" in proc.stdout  # lengths <= L
    ppl = {r["length"]: r["ppl"] for r in rec["results"]}
    assert float(rows[32]["ppl"]) == pytest.approx(ppl[32]) and float(rows[64]["ppl"]) == pytest.approx(ppl[64])
    assert rows[48]["ppl"] == "" and rows[64]["passkey_accuracy"] == ""  # a probe-only length; a length not probed
    assert rows[48]["scheme"] == "rope" and rows[48]["train_length"] == "32"

    report = run_cli("report", str(run), "--out", str(tmp_path / "report"))  # results.csv's readers still read it
    assert report.returncode == 0, report.stdout + report.stderr

    again = run_cli("eval", f"run={run}", "eval.probes=[passkey]", "eval.lengths=[64]", "eval.max_tokens=128",
                    "eval.passkey.trials=3")
    assert again.returncode == 0, again.stdout + again.stderr
    (evaluated,) = run.glob("eval-*.json")
    outcomes = [t["correct"] for t in json.loads(evaluated.read_text())["passkey"]["trials"]]
    assert len(outcomes) == 15 and probe_line(again.stdout, 64).split()[:4] == ["64", "15", str(sum(outcomes)),
                                                                                f"{sum(outcomes) / 15:.0%}"]
    assert int(csv_rows(evaluated.with_suffix(".csv"))[64]["passkey_trials"]) == 15


# ---- item 7a: Ctrl-C during posbench eval ---------------------------------------------------------------------


SCORING_STARTED = """
import os, time
from pathlib import Path

import posbench.evaluation.perplexity as perplexity

_evaluate = perplexity.evaluate


def evaluate(*args, **kwargs):  # the test's pause: scoring has begun, and waits for the test's Ctrl-C
    Path(os.environ["POSBENCH_TEST_SCORING"]).touch()
    time.sleep(600)
    return _evaluate(*args, **kwargs)


perplexity.evaluate = evaluate
"""


def test_ctrl_c_during_eval_says_the_evaluation_was_interrupted_and_how_to_rerun_it(existing_run, tmp_path):
    """Ctrl-C while ``posbench eval`` scores: one line saying so and how to evaluate again, exit 130, the run folder
    as it was. Deterministic: a ``sitecustomize`` given to the child holds its scoring at its start (a marker file, then
    a wait) until the test's SIGINT, so the signal always lands during the evaluation, never before it or after."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SCORING_STARTED)
    marker = tmp_path / "scoring"
    before = {k: v for k, v in snapshot(existing_run).items() if k != "."}
    proc = subprocess.Popen([sys.executable, "-m", "posbench", "eval", f"run={existing_run}", "device=cpu", "threads=1",
                             "eval.lengths=[32,64]"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=cli_env(PYTHONPATH=str(hook), POSBENCH_TEST_SCORING=str(marker)), text=True,
                            preexec_fn=ctrl_c_as_in_a_terminal)
    deadline = time.monotonic() + CLI_TIMEOUT_S
    while not marker.exists():  # the job was prepared, Hydra's job runs it, scoring has begun
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out waiting for the evaluation to start"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stdout + stderr and "KeyboardInterrupt" not in stderr, stderr
    (line,) = stderr.strip().splitlines()
    assert line.startswith("posbench: interrupted (Ctrl-C) during posbench eval"), line
    assert "run the same posbench eval command again" in line and "training" not in line and "hydra.run.dir" not in line
    after = {k: v for k, v in snapshot(existing_run).items() if k not in (".", "eval.log")}
    assert after == before, "the interrupted evaluation changed the run folder"


# ---- item 7b, 7c: bad values refused with one line ------------------------------------------------------------

EVAL_REFUSALS = {
    # id: (posbench eval overrides, regexes the message must hold)
    "probes-not-a-list": (["eval.probes=passkey"], [r"eval\.probes=passkey", r"must be a list",
                                                   r"'eval\.probes=\[passkey\]'"]),
    "lengths-not-a-list": (["eval.lengths=64"], [r"eval\.lengths=64", r"must be a list", r"'eval\.lengths=\[64\]'"]),
    "scheme-group": (["scheme=alibi"], [r"^scheme=alibi", r"scheme cannot be changed by posbench eval",
                                        r"options of the run's or checkpoint's scheme", r"scheme\.scaling=yarn"]),
    "model-group": (["model=small"], [r"^model=small", r"model cannot be changed by posbench eval", r"eval\.\*"]),
}


@pytest.mark.parametrize("case", list(EVAL_REFUSALS))
def test_bad_eval_overrides_are_refused_with_posbench_s_line(case, run_cli, posbench_here, existing_run):
    """In this process (``posbench_here``); the first case also as a process of its own."""
    overrides, patterns = EVAL_REFUSALS[case]
    cli = run_cli if case == next(iter(EVAL_REFUSALS)) else posbench_here
    before = snapshot(existing_run)
    line = refused(cli("eval", f"run={existing_run}", *overrides), existing_run, before)
    assert all(re.search(p, line) for p in patterns), line


TRAIN_REFUSALS = {
    "probes-not-a-list": (["eval.probes=passkey"], [r"eval\.probes=passkey", r"must be a list",
                                                   r"'eval\.probes=\[passkey\]'"]),
    "needle-longer-than-the-window": (["data.passkey_rate=0.5", "train.seq_len=8", "eval.lengths=[8,16]"],
                                      [r"data\.passkey_rate=0\.5", r"train\.seq_len \+ 1 = 9",
                                       r"a window of at least 21 tokens \(train\.seq_len >= 20\)"]),
}


@pytest.mark.parametrize("case", list(TRAIN_REFUSALS))
def test_bad_train_values_are_refused_with_posbench_s_line(case, run_cli, posbench_here, data_cache, existing_run):
    """In this process (``posbench_here``); the first case also as a process of its own."""
    overrides, patterns = TRAIN_REFUSALS[case]
    cli = run_cli if case == next(iter(TRAIN_REFUSALS)) else posbench_here
    before = snapshot(existing_run)
    line = refused(run_into(cli, data_cache, existing_run, *overrides), existing_run, before)
    assert all(re.search(p, line) for p in patterns), line


# ---- item 7d: eval file names -----------------------------------------------------------------------------------


def test_a_fine_tuned_runs_eval_files_have_no_space_in_their_names(run_cli, data_cache, trained_run, tmp_path):
    run = tmp_path / "ft"
    proc = run_into(run_cli, data_cache, run, f"init_from={trained_run}", "scheme=nope", "train.steps=1",
                    "eval.lengths=[32]", "eval.max_tokens=64")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((run / "results.json").read_text())["label"] == "rope→nope ft32×1"
    again = run_cli("eval", f"run={run}", "eval.lengths=[32]", "eval.max_tokens=64")
    assert again.returncode == 0, again.stdout + again.stderr
    names = sorted(p.name for p in run.glob("eval-*"))
    assert names == ["eval-rope-to-nope_ft32x1-nonoverlapping-validation-1.csv",
                     "eval-rope-to-nope_ft32x1-nonoverlapping-validation-1.json"]
    assert json.loads((run / names[1]).read_text())["label"] == "rope→nope ft32×1"  # the record keeps the label
    assert f"written: {run / names[1]}" in again.stdout
