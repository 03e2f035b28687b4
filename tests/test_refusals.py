"""Values ``posbench train`` must refuse before it touches anything, and their accepted neighbours.

Every refusal: exit status 2, stderr exactly one line ``posbench: error: ...`` naming the bad value and
what is allowed, no traceback, and an existing run folder given as ``hydra.run.dir`` left as it was
(every file's bytes and mtime, no new file or folder: no ``.hydra/`` rewrite, no ``wandb/``): helpers.refused.

The refusals are checked in this process (conftest's ``posbench_here``: the CLI's ``main`` up to where Hydra would
start the job, milliseconds each); two commands run in a real process, for what only a process shows: nothing but
the one line on stderr, no traceback, the run folder untouched or never made.

The existing run folder is a copy of the session's ``trained_run`` (a finished ``debug=fast`` run: 4 steps),
so other tests that read it are not disturbed. Every command carries ``debug=fast`` so that a value the CLI
fails to refuse costs a few seconds of training, not the full default run.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from helpers import compose_train, kept_torch_state, refused, rows, run_into, snapshot, steps_of


def value(key: str, number: str) -> str:
    """A regex for ``key=number`` as a message may print it (``-1`` or ``-1.0``; ``0.001`` or ``1e-03``)."""
    forms = {number, repr(float(number)), f"{float(number):g}"}
    return re.escape(key) + r"=" + "(" + "|".join(re.escape(v) for v in forms) + r")(?![\d.])"


# ---- optimizer values --------------------------------------------------------------------------

BETAS_ALLOWED = r"<\s*1|\[0,\s*1\)"  # each beta below 1 (0 <= beta < 1, or [0, 1))

BAD = {
    # id: (overrides, checks of the message: regexes that must all be found)
    "grad-clip-negative": (["train.grad_clip=-1"],
                           [value("train.grad_clip", "-1"), r"no clipping|>=\s*0|non-negative"]),
    "min-lr-above-lr": (["train.min_lr=0.01", "train.lr=0.001"],
                        [value("train.min_lr", "0.01"), r"train\.lr", r"(?<![\d.])(0\.001|1e-0?3)(?![\d.])",
                         r"between|<=|at most|must not exceed|not above"]),
    "weight-decay-negative": (["train.weight_decay=-0.1"],
                              [value("train.weight_decay", "-0.1"), r">=\s*0|non-negative"]),
    "beta2-is-1": (["train.betas=[0.9,1.0]"], [r"train\.betas=\[0\.9,\s*1(\.0)?\]", BETAS_ALLOWED]),
    "beta1-negative": (["train.betas=[-0.1,0.95]"], [r"train\.betas=\[-0\.1,\s*0\.95\]", r"0\s*<=|>=\s*0", BETAS_ALLOWED]),
    "one-beta": (["train.betas=[0.9]"], [r"train\.betas=\[0\.9\]", r"\btwo\b|\b2\b"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_optimizer_value_is_refused_and_the_run_folder_untouched(case, posbench_here, data_cache, existing_run):
    overrides, checks = BAD[case]
    before = snapshot(existing_run)
    message = refused(run_into(posbench_here, data_cache, existing_run, *overrides), existing_run, before)
    for check in checks:
        assert re.search(check, message), f"{check!r} not in {message!r}"


def test_a_refusal_in_a_real_process_is_one_line_and_leaves_the_run_folder_as_it_was(run_cli, data_cache, existing_run):
    """The process-level contract of a bad value, once: exit status 2, nothing on stderr but the line (no
    traceback, no warning, no log line), and nothing of the run folder rewritten (Hydra's ``.hydra/`` included)."""
    before = snapshot(existing_run)
    message = refused(run_into(run_cli, data_cache, existing_run, "train.grad_clip=-1"), existing_run, before)
    assert re.search(value("train.grad_clip", "-1"), message), message


def test_bad_optimizer_value_creates_no_run_folder(run_cli, data_cache, tmp_path):
    run_dir = tmp_path / "never"
    proc = run_into(run_cli, data_cache, run_dir, "train.grad_clip=-1")
    assert proc.returncode == 2, proc.stderr
    assert not run_dir.exists(), sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    refused(proc, run_dir, {})  # and the rest of the contract: one line, no traceback


# ---- grad_clip=0: no clipping ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip_runs(data_cache, tmp_path_factory) -> dict:
    """Finished debug=fast runs trained in this process (one thread each, so they are bit-comparable) with
    grad_clip 0, 1 and 1000: {clip: (run folder, the gradient norm of each optimizer step)}. The norms are those
    of the gradients AdamW steps with, recorded by an optimizer pre-step hook."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from posbench.jobs import train_job
    from posbench.training import loop as train_mod

    stepped: list[float] = []

    def record(optimizer, args, kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        stepped.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())

    runs = {}
    for clip in ("0", "1", "1000"):
        run = tmp_path_factory.mktemp(f"clip-{clip}") / "run"
        run.mkdir()
        cfg = compose_train(data_cache, f"train.grad_clip={clip}", "train.threads=1")
        stepped.clear()
        handle = register_optimizer_step_pre_hook(record)
        try:
            with kept_torch_state():
                assert train_mod.train(train_job.prepare(cfg, run))["status"] == "complete"
        finally:
            handle.remove()
        runs[clip] = run, list(stepped)
    return runs


def test_grad_clip_0_is_accepted_and_trains(clip_runs):
    run, _ = clip_runs["0"]
    logged = rows(run)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    losses = [r["loss"] for r in logged]
    assert all(math.isfinite(x) for x in losses), losses
    assert len(set(losses)) == len(losses), f"the loss does not change between steps: {losses}"
    assert json.loads((run / "results.json").read_text())["status"] == "complete"
    assert (run / "checkpoint.pt").exists()


def test_grad_clip_0_means_no_clipping(clip_runs):
    """A clip at 1000 never triggers at these gradient norms, so "no clipping" must match it bit for bit;
    a clip to norm 0 (gradients zeroed) would match at step 1 (before any update) and differ by step 4."""
    none, loose = rows(clip_runs["0"][0]), rows(clip_runs["1000"][0])
    assert max(r["grad_norm"] for r in loose) < 1000  # the premise: the loose clip never triggered
    assert none[0]["loss"] == loose[0]["loss"]
    assert none[3]["loss"] == loose[3]["loss"], (
        f"grad_clip=0 trained differently from an unclipped run: {[r['loss'] for r in none]} vs {[r['loss'] for r in loose]}")
    assert [r["grad_norm"] for r in none] == [r["grad_norm"] for r in loose]


@pytest.mark.parametrize("clip", [0, 1])
def test_grad_clip_0_steps_with_the_unclipped_gradients_in_process(clip, clip_runs):
    """In process: the gradients AdamW steps with have the norm metrics.jsonl logs (the norm before clipping)
    when grad_clip=0: clip_grad_norm_ neither zeroed nor scaled them. grad_clip=1 shows the check can tell:
    these norms are above 1, so there the optimizer steps with norm 1."""
    run, stepped = clip_runs[str(clip)]
    logged = [r["grad_norm"] for r in rows(run)]
    assert len(stepped) == len(logged) == 4 and all(n > 1 for n in logged), (stepped, logged)
    if clip == 0:
        assert stepped == pytest.approx(logged, rel=1e-5), "grad_clip=0 clipped the gradients"
    else:
        assert stepped == pytest.approx([1.0] * 4, rel=1e-4)


# ---- a resume that cannot be honoured ------------------------------------------------------------


@pytest.mark.parametrize("steps", [2, 8])
def test_changed_step_count_of_an_existing_run_is_refused(steps, posbench_here, data_cache, existing_run):
    """The learning-rate schedule is a function of train.steps: a finished 4-step run re-run with another
    step count (shorter or longer) would splice two cosine schedules, so it is refused."""
    assert json.loads((existing_run / "results.json").read_text())["config"]["train"]["steps"] == 4
    before = snapshot(existing_run)
    message = refused(run_into(posbench_here, data_cache, existing_run, f"train.steps={steps}"), existing_run, before)
    assert "train.steps" in message, message
    assert re.search(rf"(?<![\d.]){steps}(?![\d.])", message) and re.search(r"(?<![\d.])4(?![\d.])", message), message
    assert "resume=never" in message or "new run folder" in message, message  # what is allowed


def test_resume_never_with_a_changed_step_count_starts_over(posbench_here, data_cache, existing_run, torch_state):
    """Not refused (the command line passes every check), and the job, trained here in process, starts over."""
    from posbench.jobs import train_job
    from posbench.training import loop as train_mod

    proc = run_into(posbench_here, data_cache, existing_run, "train.steps=2", "resume=never")
    assert proc.returncode == 0 and "Hydra started the train job" in proc.stderr, proc.stdout + proc.stderr
    job = train_job.prepare(compose_train(data_cache, "train.steps=2", "resume=never"), existing_run)
    assert train_mod.train(job)["status"] == "complete"
    assert steps_of(existing_run) == [1, 2]
    rec = json.loads((existing_run / "results.json").read_text())
    assert rec["resumed_from"] is None and rec["config"]["train"]["steps"] == 2


# ---- train.device=cuda without CUDA --------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_refused_before_the_run_folder_is_touched(posbench_here, data_cache, existing_run):
    config = existing_run / ".hydra" / "config.yaml"
    stamp = (config.read_bytes(), config.stat().st_mtime_ns)
    before = snapshot(existing_run)
    message = refused(run_into(posbench_here, data_cache, existing_run, "train.device=cuda"), existing_run, before)
    assert re.search(r"train\.device='?cuda'?", message), message
    assert "cpu" in message, message  # what is allowed
    assert (config.read_bytes(), config.stat().st_mtime_ns) == stamp
    assert not (existing_run / "wandb").exists()


# ---- values that used to end in a traceback or a misleading message ------------------------------------------

ROUGH = {
    # id: (overrides, substrings the message must hold, substrings it must not)
    "negative-seed": (["seed=-1"], ["seed=-1", ">= 0"], []),
    "nan-lr": (["train.lr=nan"], ["train.lr=nan", "finite"], ["min_lr"]),
    "inf-lr": (["train.lr=inf"], ["train.lr=inf", "finite"], ["min_lr"]),
    "nan-weight-decay": (["train.weight_decay=nan"], ["train.weight_decay=nan"], []),
    "lengths-out-of-order": (["eval.lengths=[64,32]"], ["eval.lengths=[64, 32]", "increasing", "[32,64]"], []),
    "lengths-repeated": (["eval.lengths=[32,32]"], ["eval.lengths=[32, 32]", "without repeats", "[32]"], []),
    "stride-without-sliding": (["eval.stride=16"], ["eval.stride=16", "eval.protocol=sliding"], []),
}


@pytest.mark.parametrize("case", list(ROUGH))
def test_bad_value_is_refused_with_one_line_and_the_run_folder_untouched(case, posbench_here, data_cache, existing_run):
    overrides, found, absent = ROUGH[case]
    before = snapshot(existing_run)
    message = refused(run_into(posbench_here, data_cache, existing_run, *overrides), existing_run, before)
    assert all(s in message for s in found), message
    assert not any(s in message for s in absent), message
