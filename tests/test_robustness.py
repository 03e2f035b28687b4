"""Checks that must hold in production, not only under a debugger (issue: cluster robustness, item 7): the
evaluation's coverage invariant is a real error (``python -O`` strips asserts), and ``train.compile`` falls
back to eager only when the first compiled call fails, never silently later; and syncing with the host
every k steps changes no number."""

import json

import numpy as np
import pytest
import torch

from posbench import evaluate as ev
from posbench import train, train_job
from posbench.build import build_model


def test_windows_that_miss_targets_raise_a_real_error(monkeypatch):
    model = build_model({"vocab_size": 50, "model": {"n_layer": 1, "n_head": 2, "d_model": 16, "d_ff": 32},
                         "scheme": {"name": "nope"}})
    real = ev.windows
    monkeypatch.setattr(ev, "windows", lambda *a, **k: real(*a, **k)[:-1])  # a window lost: targets unscored
    tokens = np.random.default_rng(0).integers(0, 50, 400)
    with pytest.raises(RuntimeError, match="scored .* targets, expected"):
        ev.evaluate(model, tokens, [32], "nonoverlapping", None, 256, 1024, torch.device("cpu"))


class Flaky:
    """A stand-in for a compiled model: ``fail_at`` lists the calls (1-based) that raise."""

    def __init__(self, fail_at):
        self.calls, self.fail_at = 0, set(fail_at)

    def __call__(self, x, **kwargs):
        self.calls += 1
        if self.calls in self.fail_at:
            raise RuntimeError(f"compiled call {self.calls} failed")
        return "compiled"


def test_compile_falls_back_to_eager_only_at_the_first_call(monkeypatch):
    eager = lambda x, **kwargs: "eager"  # noqa: E731
    monkeypatch.setattr(torch, "compile", lambda net: Flaky({1}))
    fwd = train._compiled(eager)
    assert [fwd(0), fwd(0)] == ["eager", "eager"]  # the first call failed to compile: eager from then on

    monkeypatch.setattr(torch, "compile", lambda net: Flaky({3}))
    fwd = train._compiled(eager)
    assert [fwd(0), fwd(0)] == ["compiled", "compiled"]
    with pytest.raises(RuntimeError, match="compiled call 3 failed"):  # a later error is the step's, not a fallback
        fwd(0)


def test_syncing_every_4_steps_logs_the_numbers_of_syncing_every_step(tmp_path, tmp_path_factory, torch_state):
    """train.sync_every only changes when the host looks: losses, gradient norms and learning rates per step
    are the same, bit for bit, as with a sync after every step."""
    from hydra import compose, initialize_config_module

    from posbench.cli import register

    register()
    cache = tmp_path_factory.getbasetemp() / "posbench-data"  # the session's data folder (test_resume's too)
    rows = {}
    for k in (1, 4):
        with initialize_config_module("posbench.conf", version_base="1.3"):
            cfg = compose("train", overrides=["debug=fast", f"data.cache_dir={cache}", "train.steps=6", "train.threads=1",
                                              "wandb.enabled=false", f"train.sync_every={k}", "eval.lengths=[32]",
                                              "eval.max_tokens=64"])
        run = tmp_path / f"sync{k}"
        run.mkdir()
        train.train(train_job.prepare(cfg, run))
        rows[k] = [{key: v for key, v in json.loads(line).items() if key != "tokens_per_s"}
                   for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows[4]] == [1, 2, 3, 4, 5, 6]
    assert rows[4] == rows[1]
