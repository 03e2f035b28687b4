"""Randomized positions in training (``train.random_positions=M``, Ruoss et al. 2023): the positions the model is
given, re-derived here from the documented draw; off by default and then untouched; the refusals."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from helpers import compose_train as compose
from helpers import refused, run_into, snapshot, train_here
from posbench.model.gpt import GPT


@pytest.fixture
def given_positions(monkeypatch):
    """Every ``pos`` the model's forward receives, in order (None: the default 0…T−1)."""
    seen, forward = [], GPT.forward

    def spy(self, idx, pos=None, targets=None, last=None):
        seen.append(None if pos is None else pos.clone())
        return forward(self, idx, pos=pos, targets=targets, last=last)

    monkeypatch.setattr(GPT, "forward", spy)
    return seen


def train_in_process(data_cache, tmp_path, *overrides):
    from posbench.jobs import train_job
    from posbench.training.loop import train

    job = train_job.prepare(compose(data_cache, "train.steps=3", "eval.lengths=[32]", "eval.max_tokens=64",
                                    "wandb.enabled=false", *overrides), tmp_path / "run")
    return train(job)


def test_training_positions_are_the_documented_sorted_sample(data_cache, tmp_path, given_positions, torch_state):
    train_in_process(data_cache, tmp_path, "train.random_positions=200", "seed=5")
    training = given_positions[:3]  # then the evaluation's forward passes
    for step, pos in enumerate(training):
        expected = np.sort(np.random.default_rng([5, step, 0, 2]).choice(200, 32, replace=False))
        assert pos.tolist() == expected.tolist()
        assert len(set(pos.tolist())) == 32 and 0 <= pos.min() and pos.max() < 200
    assert all(p is None for p in given_positions[3:])  # evaluation: positions 0…T−1


def test_off_by_default_the_model_gets_no_positions(data_cache, tmp_path, given_positions, torch_state):
    train_in_process(data_cache, tmp_path)
    assert given_positions and all(p is None for p in given_positions)


REFUSALS = [
    (["scheme=nope", "train.random_positions=256"], r"train.random_positions=256 but scheme=nope uses no positions"),
    (["scheme=learned", "scheme.max_positions=128", "train.random_positions=256"],
     r"scheme.max_positions=128: a learned table of 128 rows cannot serve length 256"),
    (["train.random_positions=16"], r"train.random_positions=16 is smaller than train.seq_len=32"),
    (["train.random_positions=0"], r"train.random_positions=0 is not allowed"),
]


@pytest.mark.parametrize("overrides, message", REFUSALS, ids=[" ".join(r[0]) for r in REFUSALS])
def test_refusals(posbench_here, data_cache, tmp_path, overrides, message):
    run = tmp_path / "run"
    run.mkdir()
    before = snapshot(run)
    line = refused(run_into(posbench_here, data_cache, run, *overrides), run, before)
    assert re.search(message, line), line


def test_a_randomized_run_from_the_command_line(posbench_here, data_cache, tmp_path, torch_state):
    """The command line passes posbench's checks, and its job, trained in this process, records the option."""
    proc = run_into(posbench_here, data_cache, tmp_path / "run", "scheme=alibi", "train.random_positions=512")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert train_here(data_cache, tmp_path / "run", "scheme=alibi", "train.random_positions=512")["status"] == "complete"
    rec = json.loads((tmp_path / "run" / "results.json").read_text())
    assert rec["config"]["train"]["random_positions"] == 512
    assert all(torch.isfinite(torch.tensor(r["nll"])) for r in rec["results"])


@pytest.mark.parametrize("name, reads", [("nope", False), ("rope", True), ("alibi", True), ("learned", True),
                                         ("sinusoidal", True), ("t5", True), ("fire", True), ("cope", False)])
def test_which_schemes_read_positions(name, reads):
    from posbench.schemes import SCHEMES

    assert SCHEMES[name].reads_positions() is reads


@pytest.mark.parametrize("M, warned", [(48, True), (64, False), (256, False)])
def test_a_warning_when_m_is_below_the_longest_evaluation_length(M, warned, data_cache, caplog):
    """debug=fast evaluates at 32 and 64: positions past M are never trained on (the issue asks for a warning)."""
    import logging

    from posbench.config.schema import finalize

    with caplog.at_level(logging.WARNING, logger="posbench"):
        finalize(compose(data_cache, f"train.random_positions={M}"))
    expected = f"train.random_positions={M} is below the longest evaluation length 64"
    assert (expected in caplog.text) == warned, caplog.text
