"""Length-dependent attention scaling, ``model.attn_scale`` (posbench/model/gpt.py GPT): log-n scaling (Chiang & Cholak
2022: content logits × ln n / ln L) and Scalable-Softmax (Nakanishi 2025: × s_h·ln n, s learned per head and layer),
n = the keys a query sees (t + 1 for query t of a window).

The formulas are written here again, as factors on q·k/√Dh of a float64 GPT (tests/naive_gpt.py), with each
scheme's bias from its paper's formula (ALiBi's −m_h·(i − j), T5's buckets as tests/test_relative.py writes them)
and RoPE's rotation by hand; the model must match through every kernel it picks: causal SDPA (NoPE, RoPE), folded
(ALiBi), dense (T5 with gradients) and FlexAttention (T5 evaluated without gradients on CPU), at L and 4L.
Also: SSMax's gradient equals the float64 reference's, ``none`` leaves the model as it was (no parameter, no
factor), the option's refusals, and a command-line run of each scaling.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.testing import assert_close

from helpers import paper_bias, refused, run_into, snapshot, train_here
from naive_gpt import naive_logits
from posbench.model.build import build_model

VOCAB, H, D, L = 61, 4, 32, 16
ALIBI_SLOPES = [2 ** (-8 * h / H) for h in range(1, H + 1)]  # Press et al. 2022, §3: H a power of two


def model_of(scheme: str, attn_scale: str, **options):
    spec = {"vocab_size": VOCAB, "model": {"n_layer": 2, "n_head": H, "d_model": D, "d_ff": 2 * D,
                                            "attn_scale": attn_scale, "scale_length": L if attn_scale == "log_n" else None},
            "scheme": {"name": scheme, **options}}
    torch.manual_seed(7)
    model = build_model(spec).double()
    with torch.no_grad():  # content logits of order 1 (GPT-2's init gives ~1e-3), so that a factor matters
        for block in model.blocks:
            block.attn.qkv.weight.mul_(25)
    if attn_scale == "ssmax":  # s away from its initial value, different in every head and layer
        with torch.no_grad():
            for block in model.blocks:
                block.attn.ssmax.uniform_(0.1, 0.8)
    return model


def factor_of(model, attn_scale: str):
    """The documented factor of query a's content logits, per head: (H, T) float64 of n = a + 1."""
    def factor(layer, n):
        if attn_scale == "log_n":
            return (torch.log(n) / math.log(L)).expand(H, -1)
        return model.blocks[layer].attn.ssmax.double()[:, None] * torch.log(n)[None, :]
    return factor


def bias_of(model, scheme: str):
    if scheme == "alibi":
        m = torch.tensor(ALIBI_SLOPES, dtype=torch.float64)[:, None, None]
        return lambda layer, pos: -m * (pos[:, None] - pos[None, :]).double()
    if scheme == "t5":
        return lambda layer, pos: paper_bias("t5", model.scheme, pos)
    return None


@pytest.mark.parametrize("attn_scale", ["log_n", "ssmax"])
@pytest.mark.parametrize("scheme", ["nope", "rope", "alibi", "t5"])
@pytest.mark.parametrize("T", [L, 4 * L])
def test_the_model_scales_content_logits_as_the_formula(scheme, attn_scale, T):
    model = model_of(scheme, attn_scale)
    idx = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(T))
    inv_freq = 10000.0 ** (-torch.arange(0, D // H, 2, dtype=torch.float64) / (D // H)) if scheme == "rope" else None
    expected = naive_logits(model, idx[0], bias=bias_of(model, scheme), factor=factor_of(model, attn_scale),
                            inv_freq=inv_freq)
    with torch.enable_grad():  # T5: the dense kernel (gradients on, CPU)
        got = model(idx)[0]
    assert_close(got, expected, atol=1e-9, rtol=1e-9)
    unscaled = naive_logits(model, idx[0], bias=bias_of(model, scheme), inv_freq=inv_freq)
    assert (got - unscaled).abs().max() > 1e-3  # the scaling changes the model: the comparison above is not vacuous


@pytest.mark.parametrize("attn_scale", ["log_n", "ssmax"])
def test_fused_kernels_scale_too(attn_scale):
    """float32 evaluation without gradients: ALiBi through the folded kernel's blockwise path (T > 256) and T5
    through compiled FlexAttention (CPU)."""
    for scheme, T in (("alibi", 600), ("t5", 4 * L)):
        model = model_of(scheme, attn_scale)
        idx = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))
        expected = naive_logits(model, idx[0], bias=bias_of(model, scheme), factor=factor_of(model, attn_scale))
        with torch.no_grad():
            got = model.float()(idx)[0]
        assert_close(got.double(), expected, atol=2e-4, rtol=1e-4)


def test_ssmax_gradient_matches_the_reference():
    model = model_of("alibi", "ssmax")
    idx = torch.randint(0, VOCAB, (1, 3 * L), generator=torch.Generator().manual_seed(2))
    target = torch.randint(0, VOCAB, (3 * L,), generator=torch.Generator().manual_seed(3))
    model(idx, targets=target[None]).mean().backward()
    s = [block.attn.ssmax.detach().clone().requires_grad_(True) for block in model.blocks]

    def factor(layer, n):
        return s[layer][:, None] * torch.log(n)[None, :]

    logits = naive_logits(model, idx[0], bias=bias_of(model, "alibi"), factor=factor)
    torch.nn.functional.cross_entropy(logits, target).backward()
    for block, ref in zip(model.blocks, s):
        assert block.attn.ssmax.grad.abs().max() > 1e-6
        assert_close(block.attn.ssmax.grad, ref.grad, atol=1e-8, rtol=1e-6)


def test_none_adds_no_parameter_and_no_factor():
    plain, scaled = model_of("rope", "none"), model_of("rope", "ssmax")
    assert not [k for k in plain.state_dict() if "ssmax" in k]
    assert sorted(k for k in scaled.state_dict() if "ssmax" in k) == ["blocks.0.attn.ssmax", "blocks.1.attn.ssmax"]
    assert scaled.blocks[0].attn.ssmax.shape == (H,)
    idx = torch.randint(0, VOCAB, (1, L))
    inv_freq = 10000.0 ** (-torch.arange(0, D // H, 2, dtype=torch.float64) / (D // H))
    assert_close(plain(idx)[0], naive_logits(plain, idx[0], inv_freq=inv_freq), atol=1e-9, rtol=1e-9)


def test_ssmax_starts_at_its_documented_value_and_is_not_decayed():
    from omegaconf import OmegaConf

    from posbench.training.optim import make_optimizer

    torch.manual_seed(0)
    model = build_model({"vocab_size": VOCAB, "model": {"n_layer": 2, "n_head": H, "d_model": D, "d_ff": 2 * D,
                                                        "attn_scale": "ssmax"}, "scheme": {"name": "alibi"}})
    assert all(torch.equal(b.attn.ssmax, torch.full((H,), 0.43)) for b in model.blocks)
    t = OmegaConf.create({"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1})
    opt = make_optimizer(model, t, fused=False)
    undecayed = {id(p) for p in opt.param_groups[1]["params"]}
    assert all(id(b.attn.ssmax) in undecayed for b in model.blocks)


REFUSALS = [
    (["model.attn_scale=logn"], r"model.attn_scale='logn' is unknown; choose one of: none, log_n, ssmax"),
    (["model.attn_scale=log_n", "model.scale_length=1"], r"model.scale_length=1 is not allowed"),
    (["model.attn_scale=ssmax", "model.scale_length=64"], r"model.scale_length=64 applies to model.attn_scale=log_n"),
]


@pytest.mark.parametrize("overrides,message", REFUSALS)
def test_bad_scaling_is_refused_and_nothing_written(overrides, message, posbench_here, data_cache, existing_run):
    before = snapshot(existing_run)
    import re
    assert re.search(message, refused(run_into(posbench_here, data_cache, existing_run, *overrides), existing_run, before))


@pytest.mark.parametrize("attn_scale", ["log_n", "ssmax"])
def test_a_scaled_run_from_the_command_line(attn_scale, posbench_here, data_cache, tmp_path, torch_state):
    """The command line's options pass posbench's checks, and its job (trained in this process) records them."""
    run = tmp_path / attn_scale
    proc = run_into(posbench_here, data_cache, run, "scheme=alibi", f"model.attn_scale={attn_scale}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert train_here(data_cache, run, "scheme=alibi", f"model.attn_scale={attn_scale}")["status"] == "complete"
    config = json.loads((run / "results.json").read_text())["config"]
    assert config["model"]["attn_scale"] == attn_scale
    assert config["model"]["scale_length"] == (config["train"]["seq_len"] if attn_scale == "log_n" else None)
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ("blocks.0.attn.ssmax" in state["model"]) == (attn_scale == "ssmax")
    assert state["spec"]["model"]["attn_scale"] == attn_scale


def test_a_checkpoint_from_before_the_option_reads_as_none_and_can_be_fine_tuned(run_cli, data_cache, tmp_path):
    """A spec recorded without model.attn_scale and model.scale_length (every checkpoint before them) reads as
    ``none``, and a run may start from it (init_from checks every model key against the parent's)."""
    from posbench.training import checkpoint

    parent, child = tmp_path / "parent", tmp_path / "child"
    assert run_into(run_cli, data_cache, parent, "scheme=alibi").returncode == 0
    state = torch.load(parent / "checkpoint.pt", weights_only=False)
    for key in ("attn_scale", "scale_length"):
        del state["spec"]["model"][key], state["config"]["model"][key]
    torch.save(state, parent / "checkpoint.pt")
    assert checkpoint.read(parent / "checkpoint.pt")["spec"]["model"]["attn_scale"] == "none"
    proc = run_into(run_cli, data_cache, child, "scheme=alibi", f"init_from={parent}", "train.steps=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
