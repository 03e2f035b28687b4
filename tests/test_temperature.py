"""Zero-shot attention temperatures (posbench/attention/temperature.py; issue 37 item 2): ``model.attn_scale=floor_log``
(Ministral 3), ``floor_log_n`` (Llama 4) and ``log_n_clipped`` (ReRoPE, Self-Extend), exactly 1 within the train
length L, so that ``posbench eval`` applies them to a run trained without them.

The references' formulas are transcribed here, element by element: HF transformers' Ministral 3
(``1 + beta * log(1 + floor(position / original_max_position_embeddings))``), Llama 4
(``log1p(floor((position + 1) / floor_scale)) * attn_scale + 1``) and bojone/rerope
(``((position + 1).log() / log(training_length)).clip(1)``); the model must scale its content logits by them, on
every layer or on the G layers only, against the float64 GPT of tests/naive_gpt.py.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch.testing import assert_close

from helpers import eval_here, refused, run_into, snapshot
from naive_gpt import naive_logits
from posbench.attention.temperature import ZERO_SHOT, default_length, factor
from posbench.model.build import build_model

VOCAB, H, D, L = 61, 4, 32, 16
BETA = 0.1


def reference(kind: str, t: int, F: int, beta: float = BETA) -> float:
    """The factor on query t (0-based position), as each reference writes it."""
    if kind == "floor_log":  # Ministral 3
        return 1 + beta * math.log(1 + math.floor(t / F))
    if kind == "floor_log_n":  # Llama 4
        return math.log1p(math.floor((t + 1.0) / F)) * beta + 1.0
    return max(1.0, math.log(t + 1) / math.log(F))  # ReRoPE's log-n, clipped at 1


@pytest.mark.parametrize("kind", ZERO_SHOT)
def test_factors_are_the_references_and_one_within_L(kind):
    F = default_length(kind, L)
    got = factor(kind, 16 * L, F, BETA)[:, 0].tolist()
    assert got == pytest.approx([reference(kind, t, F) for t in range(16 * L)], rel=1e-15, abs=1e-15)
    assert got[:L] == [1.0] * L  # exactly: the trained model within L
    assert got[L] > 1.0  # and it acts from L on (all three step up at t = L with their default lengths)
    assert factor("floor_log", 4 * L, L, 0.3)[:, 0].tolist()[2 * L] == pytest.approx(1 + 0.3 * math.log(3))


def model_of(scheme: str, attn_scale: str, **model):
    spec = {"vocab_size": VOCAB, "model": {"n_layer": 2, "n_head": H, "d_model": D, "d_ff": 2 * D, "attn_scale": attn_scale,
                                            "scale_length": default_length(attn_scale, L) if attn_scale != "none" else None,
                                            **model}, "scheme": {"name": scheme}}
    torch.manual_seed(7)
    built = build_model(spec).double()
    with torch.no_grad():  # content logits of order 1 (GPT-2's init gives ~1e-3), so that a factor matters
        for block in built.blocks:
            block.attn.qkv.weight.mul_(25)
    return built


ROPE = 10000.0 ** (-torch.arange(0, D // H, 2, dtype=torch.float64) / (D // H))


@pytest.mark.parametrize("kind", ZERO_SHOT)
@pytest.mark.parametrize("scheme", ["nope", "rope", "alibi"])
def test_the_model_scales_content_logits_as_the_reference(kind, scheme):
    model = model_of(scheme, kind)
    T = 4 * L
    idx = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(3))
    F = default_length(kind, L)
    scale = torch.tensor([reference(kind, t, F) for t in range(T)], dtype=torch.float64)
    slopes = torch.tensor([2 ** (-8 * h / H) for h in range(1, H + 1)], dtype=torch.float64)[:, None, None]  # ALiBi §3
    bias = (lambda layer, pos: -slopes * (pos[:, None] - pos[None, :]).double()) if scheme == "alibi" else None
    expected = naive_logits(model, idx, bias=bias, factor=lambda layer, n: scale.expand(H, -1),
                            inv_freq=ROPE if scheme == "rope" else None)
    got = model(idx[None])[0]
    assert_close(got, expected, atol=1e-9, rtol=1e-9)
    unscaled = naive_logits(model, idx, bias=bias, inv_freq=ROPE if scheme == "rope" else None)
    assert (got[L:] - unscaled[L:]).abs().max() > 1e-3  # the temperature acts past L: the check above is not vacuous
    assert_close(got[:L], unscaled[:L], atol=1e-9, rtol=1e-9)


def test_global_layers_only_as_llama_4_scales_its_nope_layers():
    """LG: a sliding-window RoPE layer (W = 8) unscaled, a global NoPE layer scaled by Llama 4's form."""
    model = model_of("rope", "floor_log_n", layer_pattern="LG", global_scheme={"name": "nope"}, window=8,
                     scale_layers="global")
    T, W = 5 * L, 8
    idx = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(4))
    scale = torch.tensor([reference("floor_log_n", t, L + 1) for t in range(T)], dtype=torch.float64)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    sliding = (i - j >= 0) & (i - j < W)  # HF's sliding window: keys with 0 <= i − j < W
    expected = naive_logits(model, idx, factor=lambda layer, n: (scale if layer == 1 else torch.ones(T)).expand(H, -1),
                            inv_freq=lambda layer: ROPE if layer == 0 else None,
                            visible=lambda layer, T: sliding if layer == 0 else i >= j)
    assert_close(model(idx[None])[0], expected, atol=1e-9, rtol=1e-9)
    everywhere = model_of("rope", "floor_log_n", layer_pattern="LG", global_scheme={"name": "nope"}, window=8)
    assert (everywhere(idx[None])[0] - expected).abs().max() > 1e-3  # scale_layers=all scales the L layer too


def test_within_L_a_float32_model_is_the_trained_one_bit_for_bit():
    plain, hot = model_of("rope", "none").float(), model_of("rope", "floor_log").float()
    hot.load_state_dict(plain.state_dict())
    idx = torch.randint(0, VOCAB, (2, 4 * L), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = plain(idx), hot(idx)
    assert torch.equal(a[:, :L], b[:, :L]) and not torch.equal(a[:, L:], b[:, L:])
    assert sorted(plain.state_dict()) == sorted(hot.state_dict())  # no parameter: it applies to any trained run


REFUSALS = [  # debug=fast: L = 32
    (["model.attn_scale=floor_log", "model.scale_length=16"],
     r"model.scale_length=16 makes model.attn_scale=floor_log scale the queries from index 16 on, within the train "
     r"length L=32, .* give model.scale_length >= 32"),
    (["model.attn_scale=floor_log_n", "model.scale_length=32"], r"from index 31 on, .* >= 33"),
    (["model.scale_beta=0.2"], r"model.scale_beta=0.2 applies to model.attn_scale=floor_log or floor_log_n"),
    (["model.attn_scale=floor_log", "model.scale_beta=-1"], r"model.scale_beta=-1.0 is not allowed: .* > 0"),
    (["model.attn_scale=log_n", "model.scale_layers=global"], r"model.scale_layers=global applies to the zero-shot"),
    (["model.attn_scale=floor_log", "model.scale_layers=global"],
     r"model.scale_layers=global scales the G layers beside L layers, and model.layer_pattern=G at 4 layers has no L"),
]


@pytest.mark.parametrize("overrides,message", REFUSALS)
def test_bad_temperatures_are_refused_and_nothing_written(overrides, message, posbench_here, data_cache, existing_run):
    before = snapshot(existing_run)
    assert re.search(message, refused(run_into(posbench_here, data_cache, existing_run, *overrides), existing_run, before))


def ppls(path) -> dict:
    return {r["length"]: r["ppl"] for r in json.loads(path.read_text())["results"]}


def test_posbench_eval_applies_a_temperature_to_a_trained_run(existing_run, torch_state):
    """``posbench eval run=<rope run> model.attn_scale=floor_log``: the same perplexity at L (the factor is 1 there),
    another past it; the record says what changed, and the report names the run it was applied to."""
    from posbench.report.records import collect
    from posbench.report.settings import label_of

    lengths = "eval.lengths=[32,128]"
    plain = eval_here(f"run={existing_run}", lengths, "eval.max_tokens=512")
    hot = eval_here(f"run={existing_run}", lengths, "eval.max_tokens=512", "model.attn_scale=floor_log")
    assert hot["label"] == "rope (floor_log at eval)" and "model_overrides" not in plain
    assert hot["model_overrides"] == {"attn_scale": "floor_log", "scale_length": 32}
    assert hot["results"][0]["nll"] == plain["results"][0]["nll"]  # at L = 32
    assert hot["results"][1]["nll"] != plain["results"][1]["nll"]  # at 4L
    records, _ = collect([existing_run])
    assert "rope (floor_log at eval)" in {label_of(r) for r in records}
    scaled = eval_here(f"run={existing_run}", lengths, "eval.max_tokens=512", "model.attn_scale=log_n_clipped",
                       "model.scale_length=64")
    assert scaled["label"] == "rope (log_n_clipped64 at eval)" and scaled["results"][0]["nll"] == plain["results"][0]["nll"]


EVAL_REFUSALS = [
    (["model.attn_scale=log_n"], r"model.attn_scale=log_n changes training and cannot be applied after it; at "
                                 r"evaluation give one of: none, floor_log, floor_log_n, log_n_clipped"),
    (["model.attn_scale=floor_log", "model.scale_length=8"], r"model.scale_length=8 makes .* within the train length"),
    (["model.n_layer=2"], r"model.n_layer=2: <run> has model.n_layer=4; posbench eval scores the model as it was "
                          r"trained"),
]


@pytest.mark.parametrize("overrides,message", EVAL_REFUSALS)
def test_posbench_eval_refuses_what_changes_training(overrides, message, posbench_here, existing_run):
    before = snapshot(existing_run)
    proc = posbench_here("eval", f"run={existing_run}", *overrides)
    assert re.search(message, refused(proc, existing_run, before))
