"""posbench.model.gpt with every scheme: causality at the train length and past it, the attention layer (through
posbench/attention/dispatch.py's kernels) against a naive attention written here, and the state_dict keys that
checkpoints written before the attention kernels were split out still carry.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from posbench.attention import blockwise, dense, dispatch
from posbench.model.blocks import Attention
from posbench.model.build import build_model
from posbench.model.gpt import GPT
from posbench.schemes import SCHEMES, build_scheme

L = 16  # the "train length" of these random-init models
VOCAB = 61
ALL = sorted(SCHEMES)


def tiny_gpt(name: str, n_layer=2, n_head=2, d_model=32, max_positions=8 * L, seed=0) -> GPT:
    torch.manual_seed(seed)
    spec = {"vocab_size": VOCAB, "scheme": {"name": name},
            "model": {"n_layer": n_layer, "n_head": n_head, "d_model": d_model, "d_ff": 2 * d_model, "dropout": 0.0}}
    table = {"scheme": {"max_positions": max_positions}} if name == "learned" else {}
    return build_model(spec, table).eval()


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


@pytest.mark.parametrize("kernel", ["folded", "dense"])
def test_causal_with_many_bias_blocks(kernel, monkeypatch):
    """ALiBi's query-blocked kernels (several blocks, ragged last block) are causal too."""
    model = tiny_gpt("alibi")
    T = 4 * L
    monkeypatch.setattr(dispatch, "choose_kernel", lambda *args: kernel)
    monkeypatch.setattr(blockwise, "FOLD_QUERIES", 5)
    monkeypatch.setattr(dense, "BIAS_ELEMENTS", 2 * T * 5)  # 5 queries per block with 2 heads
    idx = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = model(idx)
        for t in (0, 4, 5, 9, 30, T - 2):
            changed = idx.clone()
            changed[:, t + 1] = (idx[:, t + 1] + 7) % VOCAB
            assert_close(model(changed)[:, : t + 1], base[:, : t + 1])


# ---- naive attention against the model's fused path -----------------------------------------------


def naive_attention(attn: Attention, scheme, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ/√Dh + bias + causal mask) · v, in float64, with explicit loops-free einsums; the scheme's
    rotation and bias through its hooks (checked against the papers in tests/test_positional.py)."""
    B, T, D = x.shape
    H = attn.n_head
    Dh = D // H
    W = attn.qkv.weight.double()  # (3D, D): rows q | k | v, heads contiguous within each
    xd = x.double()
    q, k, v = (xd @ W[i * D:(i + 1) * D].T for i in range(3))  # 3 × (B, T, D)
    q, k, v = (t.view(B, T, H, Dh).transpose(1, 2) for t in (q, k, v))  # 3 × (B, H, T, Dh)
    q, k = scheme.rotate(q, k, scheme.rotation(pos, torch.float64))
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(Dh)  # (B, H, T, T)
    zero = torch.zeros((), dtype=torch.float64)
    scores = scores + scheme.score_mod(zero, torch.arange(H)[:, None, None], pos[None, :, None], pos[None, None, :])
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # j > i
    scores = scores.masked_fill(future, float("-inf"))
    y = torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), v)  # (B, H, T, Dh)
    y = y.transpose(1, 2).reshape(B, T, D)
    return y @ attn.proj.weight.double().T


def make_attention(name, d_model=32, n_head=4, seed=0):
    torch.manual_seed(seed)
    scheme = build_scheme(name, d_model, n_head, **({"max_positions": 256} if name == "learned" else {}))
    attn = Attention(d_model, n_head, scheme).eval()
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
        assert_close(attn(x, dispatch.context(scheme, pos, 4)).double(), naive_attention(attn, scheme, x, pos),
                     atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["folded", "dense"])
@pytest.mark.parametrize("n_head", [4, 6])
@pytest.mark.parametrize("queries_per_block", [1, 3, 5, 64])
def test_bias_kernels_in_query_blocks_match_naive(queries_per_block, n_head, kernel, monkeypatch):
    """ALiBi through several query blocks (FOLD_QUERIES, BIAS_ELEMENTS made small): same output, one bias
    block per query block, none larger than its budget."""
    T, d_model = 23, 8 * n_head
    attn, scheme = make_attention("alibi", d_model=d_model, n_head=n_head)
    budget = n_head * T * queries_per_block
    monkeypatch.setattr(dense, "BIAS_ELEMENTS", budget)
    monkeypatch.setattr(blockwise, "FOLD_QUERIES", queries_per_block)
    calls = []
    real_score_mod = scheme.score_mod

    def spy(*args):
        out = real_score_mod(*args)
        calls.append(out.numel())
        return out

    monkeypatch.setattr(scheme, "score_mod", spy)
    x = torch.randn(2, T, d_model, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(T) + 3
    with torch.no_grad():
        y = attn(x, dispatch.context(scheme, pos, n_head, kernel=kernel))
    monkeypatch.setattr(scheme, "score_mod", real_score_mod)
    assert_close(y.double(), naive_attention(attn, scheme, x, pos), atol=2e-5, rtol=1e-4)
    assert len(calls) == math.ceil(T / min(T, queries_per_block))  # one bias block per query block, no probe
    assert max(calls) <= (budget if kernel == "dense" else n_head * T)  # dense (H, Q, T) blocks; folded (H, T) keys


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


# ---- checkpoints written before the attention kernels moved to posbench/attention/dispatch.py -------------------

BLOCK_KEYS = ["ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attn.qkv.weight", "attn.proj.weight",
              "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"]
STATE_DICT_KEYS = ["tok.weight", *(f"blocks.{i}.{key}" for i in range(2) for key in BLOCK_KEYS), "ln_f.weight",
                   "ln_f.bias", "head.weight"]  # the keys of a 2-layer model at commit d46b673, in order


@pytest.mark.parametrize("name", ALL)
def test_state_dict_keys_are_those_of_older_checkpoints(name):
    """Every scheme's model keeps exactly the keys (and order) checkpoints were written with, so they load
    with strict=True: of the classic schemes only the learned table is saved; a newer scheme saves its learned
    parameters; no buffer (slopes, frequencies, masks, rotation tables) is saved."""
    model = tiny_gpt(name)
    classic = {"nope": [], "sinusoidal": [], "rope": [], "alibi": [], "learned": ["scheme.table.weight"]}
    own = classic[name] if name in classic else [f"scheme.{n}" for n, _ in model.scheme.named_parameters()]
    assert list(model.state_dict()) == own + STATE_DICT_KEYS


def test_tied_embeddings_and_width_check():
    model = tiny_gpt("rope")
    assert model.head.weight is model.tok.weight
    with pytest.raises(ValueError):
        GPT(VOCAB, 1, 3, 32, 64, build_scheme("nope", 32, 3))


# ---- dropout: residual (model.dropout) and attention (model.attn_dropout) ------------------------------------


def test_attention_dropout_is_its_own_option(monkeypatch):
    """``dropout`` drops the embeddings and residual branches only; ``attn_dropout`` alone reaches the attention
    contexts (so a bias scheme keeps FlexAttention on CUDA under residual dropout), in training mode only."""
    seen = []  # the dropout of every attention context made
    real = dispatch.context

    def spy(scheme, pos, n_head, dtype=torch.float32, dropout=0.0, **kwargs):
        seen.append(dropout)
        return real(scheme, pos, n_head, dtype, dropout, **kwargs)

    monkeypatch.setattr(dispatch, "context", spy)
    idx = torch.randint(0, VOCAB, (2, L), generator=torch.Generator().manual_seed(0))
    spec = {"vocab_size": VOCAB, "scheme": {"name": "alibi"},
            "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "dropout": 0.1, "attn_dropout": 0.0}}
    residual = build_model(spec).train()
    assert residual.drop.p == 0.1 and all(b.drop.p == 0.1 and b.mlp[3].p == 0.1 for b in residual.blocks)
    residual(idx)
    assert seen == [0.0]  # one shared scheme: one context, without attention dropout
    both = build_model(spec, {"model": {"attn_dropout": 0.2}}).train()
    both(idx)
    assert seen[1:] == [0.2]
    both.eval()(idx)
    assert seen[2:] == [0.0]  # evaluation never drops
    with pytest.raises(ValueError, match="attn_dropout=1.0"):
        GPT(VOCAB, 1, 2, 32, 64, build_scheme("alibi", 32, 2), attn_dropout=1.0)
