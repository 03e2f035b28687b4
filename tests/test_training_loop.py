"""The training loop's machinery (posbench/training/optim.py and loop.py): ``train.compile`` falls back to eager only
when the first compiled call fails, never silently later; and syncing with the host every k steps
(``train.sync_every``) changes no number.

(The evaluation's coverage invariant, a real error rather than an assert, is in test_evaluate_windows.py.)"""

import json

import pytest
import torch

from helpers import compose_train
from posbench.jobs import train_job
from posbench.training import loop, optim


class Boom(torch.autograd.Function):
    """Identity whose backward raises, as Inductor does when it compiles a backward it cannot lower."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("backward failed to compile")


class Flaky(torch.nn.Module):
    """A stand-in for a compiled model: forward calls in ``fail_at`` (1-based) raise; with ``bad_backward`` every
    output's backward raises."""

    def __init__(self, net, fail_at=(), bad_backward=False):
        super().__init__()
        self.net, self.calls, self.fail_at, self.bad_backward = net, 0, set(fail_at), bad_backward

    def forward(self, x):
        self.calls += 1
        if self.calls in self.fail_at:
            raise RuntimeError(f"compiled call {self.calls} failed")
        y = self.net(x)
        return Boom.apply(y) if self.bad_backward else y


def one_step(fwd, net, optimizer):
    x = torch.ones(2, 3)
    loss = fwd(x).sum()
    optimizer.zero_grad(set_to_none=True)
    return fwd.backward(loss, lambda: fwd(x).sum(), optimizer)


@pytest.mark.parametrize("failure", ["forward", "backward"])
def test_compile_falls_back_to_eager_in_the_first_step_only(monkeypatch, caplog, failure):
    """A compiler failure in the first step's forward or backward: eager from then on, the step's gradients the
    eager model's; after a first step that succeeded, a failure is the step's error."""
    net = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    flaky = Flaky(net, fail_at={1} if failure == "forward" else (), bad_backward=failure == "backward")
    monkeypatch.setattr(torch, "compile", lambda module: flaky)
    fwd = optim.Forward(net, compile=True)
    loss = one_step(fwd, net, optimizer)
    assert fwd.run is net and "training in eager mode" in caplog.text
    torch.testing.assert_close(net.weight.grad, torch.full((1, 3), 2.0))  # d/dW of Σ (W·1 + b) over 2 rows, once
    assert loss.item() == pytest.approx(net(torch.ones(2, 3)).sum().item())

    flaky = Flaky(net, fail_at={2})
    monkeypatch.setattr(torch, "compile", lambda module: flaky)
    fwd = optim.Forward(net, compile=True)
    one_step(fwd, net, optimizer)  # the first step compiled, forward and backward
    assert fwd.run is flaky
    with pytest.raises(RuntimeError, match="compiled call 2 failed"):  # a later error is the step's, not a fallback
        one_step(fwd, net, optimizer)


def test_syncing_every_4_steps_logs_the_numbers_of_syncing_every_step(tmp_path, data_cache, torch_state):
    """train.sync_every only changes when the host looks: losses, gradient norms and learning rates per step
    are the same, bit for bit, as with a sync after every step."""
    rows = {}
    for k in (1, 4):
        cfg = compose_train(data_cache, "train.steps=6", "train.threads=1", "wandb.enabled=false",
                            f"train.sync_every={k}", "eval.lengths=[32]", "eval.max_tokens=64")
        run = tmp_path / f"sync{k}"
        run.mkdir()
        loop.train(train_job.prepare(cfg, run))
        rows[k] = [{key: v for key, v in json.loads(line).items() if key != "tokens_per_s"}
                   for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows[4]] == [1, 2, 3, 4, 5, 6]
    assert rows[4] == rows[1]
