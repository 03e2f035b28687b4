"""posbench.model with every scheme: causality at the train length and past it, and the fused attention
path (SDPA, query-blocked bias) against a naive attention written here.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

import posbench.model
from posbench.checkpoint import build_model
from posbench.model import GPT, Attention
from posbench.positional import SCHEMES, build_scheme

L = 16  # the "train length" of these random-init models
VOCAB = 61
ALL = sorted(SCHEMES)


def tiny_gpt(name: str, n_layer=2, n_head=2, d_model=32, max_positions=8 * L, seed=0) -> GPT:
    torch.manual_seed(seed)
    config = {"model": {"name": "t", "n_layer": n_layer, "n_head": n_head, "d_model": d_model, "d_ff": 2 * d_model,
                        "dropout": 0.0},
              "scheme": {"name": name, "base": 10000.0, "max_positions": max_positions}}
    return build_model(config, VOCAB).eval()


# ---- causality ------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [L, 4 * L], ids=["train-length", "4x-train-length"])
@pytest.mark.parametrize("name", ALL)
def test_changing_a_later_token_leaves_earlier_logits_unchanged(name, T):
    model = tiny_gpt(name)
    gen = torch.Generator().manual_seed(T)
    idx = torch.randint(0, VOCAB, (2, T), generator=gen)
    with torch.no_grad():
        base = model(idx)
        assert base.shape == (2, T, VOCAB)
        for t in sorted({0, 1, T // 3, T // 2, T - 2}):
            changed = idx.clone()
            changed[:, t + 1] = (idx[:, t + 1] + 1 + torch.arange(2)) % VOCAB
            out = model(changed)
            assert_close(out[:, : t + 1], base[:, : t + 1], msg=lambda m: f"{name}: position <= {t} saw token {t + 1}: {m}")
            assert not torch.allclose(out[:, t + 1], base[:, t + 1])  # the change itself is seen


@pytest.mark.parametrize("name", ["alibi"])
def test_causal_with_many_bias_blocks(name, monkeypatch):
    """The query-blocked bias path (several blocks, ragged last block) is causal too."""
    model = tiny_gpt(name)
    T = 4 * L
    monkeypatch.setattr(posbench.model, "BIAS_ELEMENTS", 2 * T * 5)  # 5 queries per block with 2 heads
    idx = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = model(idx)
        for t in (0, 4, 5, 9, 30, T - 2):
            changed = idx.clone()
            changed[:, t + 1] = (idx[:, t + 1] + 7) % VOCAB
            assert_close(model(changed)[:, : t + 1], base[:, : t + 1])


# ---- naive attention against the model's fused path -----------------------------------------------


def naive_attention(attn: Attention, scheme, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ/√Dh + bias + causal mask) · v, in float64, with explicit loops-free einsums."""
    B, T, D = x.shape
    H = attn.n_head
    Dh = D // H
    W = attn.qkv.weight.double()  # (3D, D): rows q | k | v, heads contiguous within each
    xd = x.double()
    q, k, v = (xd @ W[i * D:(i + 1) * D].T for i in range(3))  # 3 × (B, T, D)
    q, k, v = (t.view(B, T, H, Dh).transpose(1, 2) for t in (q, k, v))  # 3 × (B, H, T, Dh)
    q, k = scheme.rotate(q, k, pos)
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(Dh)  # (B, H, T, T)
    bias = scheme.bias(pos, pos)
    if bias is not None:
        scores = scores + bias.double()
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # j > i
    scores = scores.masked_fill(future, float("-inf"))
    y = torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), v)  # (B, H, T, Dh)
    y = y.transpose(1, 2).reshape(B, T, D)
    return y @ attn.proj.weight.double().T


def make_attention(name, d_model=32, n_head=4, seed=0):
    torch.manual_seed(seed)
    scheme = build_scheme(name, d_model, n_head, max_positions=256)
    attn = Attention(d_model, n_head, 0.0, scheme).eval()
    for p in attn.parameters():  # larger weights than GPT's init: sharper attention, a stronger test
        torch.nn.init.normal_(p, std=0.3)
    return attn, scheme


@pytest.mark.parametrize("offset", [0, 37])
@pytest.mark.parametrize("T", [1, 7, 24])
@pytest.mark.parametrize("name", ALL)
def test_attention_matches_naive(name, T, offset):
    attn, scheme = make_attention(name)
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(T))
    pos = torch.arange(T) + offset
    with torch.no_grad():
        assert_close(attn(x, pos).double(), naive_attention(attn, scheme, x, pos), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n_head", [4, 6])
@pytest.mark.parametrize("queries_per_block", [1, 3, 5, 64])
def test_bias_path_in_query_blocks_matches_naive(queries_per_block, n_head, monkeypatch):
    """ALiBi through several query blocks (BIAS_ELEMENTS made small): same output, no full bias matrix."""
    T, d_model = 23, 8 * n_head
    attn, scheme = make_attention("alibi", d_model=d_model, n_head=n_head)
    budget = n_head * T * queries_per_block
    monkeypatch.setattr(posbench.model, "BIAS_ELEMENTS", budget)
    calls = []
    real_bias = scheme.bias

    def spy(q_pos, k_pos):
        out = real_bias(q_pos, k_pos)
        calls.append(out.numel())
        return out

    monkeypatch.setattr(scheme, "bias", spy)
    x = torch.randn(2, T, d_model, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(T) + 3
    with torch.no_grad():
        y = attn(x, pos)
    monkeypatch.setattr(scheme, "bias", real_bias)
    assert_close(y.double(), naive_attention(attn, scheme, x, pos), atol=2e-5, rtol=1e-4)
    assert len(calls) >= math.ceil(T / min(T, queries_per_block))  # one call per block (and maybe a probe)
    assert max(calls) <= budget  # never more than BIAS_ELEMENTS floats of bias at once


# ---- positions are explicit -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["nope", "rope", "alibi"])
def test_relative_schemes_are_translation_invariant(name):
    """RoPE and ALiBi see only i − j: shifting every position leaves the logits unchanged."""
    model = tiny_gpt(name)
    idx = torch.randint(0, VOCAB, (2, 2 * L), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert_close(model(idx, torch.arange(2 * L) + 1000), model(idx), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ALL)
def test_only_nope_is_blind_to_order(name):
    """With one layer, the last position's logits under NoPE ignore the order of the earlier tokens;
    every other scheme sees it."""
    model = tiny_gpt(name, n_layer=1)
    for p in model.parameters():  # larger weights than GPT's init: attention far from uniform
        torch.nn.init.normal_(p, std=0.3)
    idx = torch.randint(0, VOCAB, (1, L), generator=torch.Generator().manual_seed(4))
    shuffled = torch.cat([idx[:, :-1].flip(1), idx[:, -1:]], dim=1)  # same tokens, same last one
    with torch.no_grad():
        a, b = model(idx)[:, -1], model(shuffled)[:, -1]
    change = (a - b).abs().max().item()
    if name == "nope":
        assert change < 1e-5
    else:
        assert change > 1e-4, f"{name} is blind to token order"


def test_tied_embeddings_and_width_check():
    model = tiny_gpt("rope")
    assert model.head.weight is model.tok.weight
    with pytest.raises(ValueError):
        GPT(VOCAB, 1, 3, 32, 64, build_scheme("nope", 32, 3))
