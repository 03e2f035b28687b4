"""train.precision: training's autocast. ``auto`` trains in bfloat16 autocast on CUDA and in float32 on CPU (the runs
recorded so far, bit for bit); ``bf16`` asks for bfloat16 autocast on a CPU too, refused where the CPU has no native
bfloat16; evaluation is float32 whatever the setting.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import refused, run_into, snapshot, train_here
from posbench.config import checks
from posbench.runtime.device import autocast_dtype, native_bf16_cpu

STEPS = ["train.steps=3", "eval.lengths=[32]", "eval.max_tokens=256"]


def test_auto_is_bf16_on_cuda_and_float32_on_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert autocast_dtype("auto", cuda) == torch.bfloat16 and autocast_dtype("auto", cpu) is None
    assert autocast_dtype("bf16", cpu) == autocast_dtype("bf16", cuda) == torch.bfloat16
    assert autocast_dtype("fp32", cpu) is None and autocast_dtype("fp32", cuda) is None


def test_bf16_on_a_cpu_without_native_bfloat16_is_refused(posbench_here, data_cache, tmp_path, monkeypatch):
    monkeypatch.setattr(checks, "native_bf16_cpu", lambda: False)
    run = tmp_path / "run"
    run.mkdir()
    before = snapshot(run)
    line = refused(run_into(posbench_here, data_cache, run, "train.device=cpu", "train.precision=bf16"), run, before)
    assert line.startswith("train.precision=bf16 but this CPU has no native bfloat16") and "train.precision=fp32" in line


def test_a_cpu_run_trains_under_bf16_autocast_only_when_asked(data_cache, tmp_path, torch_state):
    """``auto`` on CPU gives the float32 run's parameters bit for bit; ``bf16`` other parameters (its matmuls round to
    8-bit mantissas) and a loss within 0.05 nats of the float32 run's after 3 steps; both evaluate in float32."""
    if not native_bf16_cpu():
        pytest.skip("this CPU has no native bfloat16: train.precision=bf16 is refused here")
    runs = {p: train_here(data_cache, tmp_path / p, "train.device=cpu", f"train.precision={p}", *STEPS)
            for p in ("fp32", "auto", "bf16")}
    assert runs["auto"]["param_sha256"] == runs["fp32"]["param_sha256"]
    assert runs["bf16"]["param_sha256"] != runs["fp32"]["param_sha256"]
    assert math.isfinite(runs["bf16"]["final_loss"])
    assert abs(runs["bf16"]["final_loss"] - runs["fp32"]["final_loss"]) < 0.05
    assert runs["bf16"]["config"]["train"]["precision"] == "bf16"


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple_log"])
def test_a_bias_scheme_under_cpu_bf16_autocast_scores_as_in_float32(name):
    """bf16 attention on CPU without gradients runs a kernel whose outputs are those of bf16 arithmetic: within 0.02
    of the float64 attention (ALiBi, T5, KERPLE at T = 128). torch 2.13's compiled CPU Flex returned outputs off by up
    to 2.4 in bf16, so CPU Flex is chosen in float32 only."""
    from posbench.attention import dispatch
    from posbench.schemes import build_scheme

    torch.manual_seed(0)
    H, T, D = 4, 128, 32
    s = build_scheme(name, d_model=H * D, n_head=H)
    with torch.no_grad():
        for p in s.parameters():
            p.add_(0.3 * torch.randn_like(p))
        q, k, v = (torch.randn(1, H, T, D) for _ in range(3))
        pos = torch.arange(T)
        scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D) + s.pair_bias(pos, pos, torch.float64)
        want = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1) @ v.double()
        with torch.autocast("cpu", torch.bfloat16):
            ctx = dispatch.context(s, pos, H, torch.bfloat16)
            got = dispatch.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), ctx)
    assert ctx.kernel != "flex"
    assert (got.double() - want).abs().max() < 0.02
