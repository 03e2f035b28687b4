"""Hybrid layers: attention windows, sinks, QK-norm, a global scheme beside the local one, PoSE's positions, their
labels and memory estimate (posbench/attention/windows.py and dispatch.py, posbench/model/, posbench/data/batches.py,
posbench/evaluation/results.py),
each against a construction written here:

* windows: Hugging Face's mask functions written out on an index grid, ``sliding_window_overlay`` (kv_idx > q_idx − W)
  and ``chunked_overlay`` (kv_idx // C == q_idx // C), each ANDed with causal (kv_idx <= q_idx);
* kernels: a float64 softmax attention with the same mask, the scheme's bias (``pair_bias``; CoPE's
  ``contextual_bias`` of the masked scores, as the model adds it) and sink (GPT-OSS: one more logit in each softmax,
  its column dropped), values and gradients, through every CPU kernel the context accepts;
* the model: which positions a one-layer windowed model's logits depend on, and 4-layer hybrids (RoPE local layers
  with a window, a NoPE global layer, QK-norm = RMSNorm of each head before the rotation, sinks) against
  tests/naive_gpt.py's float64 GPT; which scheme, window and state-dict prefix each layer gets; unchanged defaults;
* PoSE (Zhu et al. 2023 §3.2, and its code's ``train_preprocess_function_pose``): u_0 = 0, u_i uniform over
  u_{i−1} … L_t − L, for N = 2 a first chunk of 1 … ⌈L/2⌉ tokens.

Compiled FlexAttention on CPU takes 10–30 s per case here: its cases run only with POSBENCH_TEST_FLEX=1.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from torch.testing import assert_close

from helpers import kept_torch_state
from naive_gpt import naive_logits
from posbench.attention import choice, dispatch, flex
from posbench.attention.windows import Window, expand_pattern
from posbench.data import batches
from posbench.evaluation import results
from posbench.model import memory
from posbench.model.build import build_model
from posbench.schemes import SCHEMES, PositionalScheme, build_scheme

H, DH = 4, 8
FLEX = os.environ.get("POSBENCH_TEST_FLEX") == "1" and flex.flex_attention is not None
VALUES, GRADS = dict(atol=2e-5, rtol=1e-4), dict(atol=5e-5, rtol=1e-4)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors run on one thread (two contend ~20× slower on a busy 2-core machine); torch's state is put back."""
    with kept_torch_state():
        torch.set_num_threads(1)
        yield


@pytest.fixture(autouse=True)
def no_flex_unless_asked(monkeypatch):
    """Without POSBENCH_TEST_FLEX=1 the kernels that would compile FlexAttention on CPU (FIRE evaluated past its
    threshold) take the dense kernel, as on a CPU where Flex does not compile."""
    if not FLEX:
        monkeypatch.setattr(flex, "cpu_compiles", False)


def hf_visible(window: Window | None, q_idx, kv_idx):
    """Hugging Face's masks (transformers masking_utils): causal_mask_function ANDed with sliding_window_overlay or
    chunked_overlay, written from their definitions (not from posbench's Window)."""
    causal = kv_idx <= q_idx
    if window is None:
        return causal
    if window.kind == "sliding":
        return causal & (kv_idx > q_idx - window.size)
    return causal & (kv_idx // window.size == q_idx // window.size)


# ---- 1. windows -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 3, 8, 13])
@pytest.mark.parametrize("kind", ["sliding", "chunked"])
def test_window_masks_are_hugging_faces(kind, size):
    """visible(i, j) on a 40 × 40 grid is HF's overlay ∧ causal; first_key(s) the first key any query ≥ s sees."""
    T = 40
    w = Window(size, kind)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    expected = hf_visible(w, i, j)
    assert torch.equal(w.visible(i, j), expected)
    assert all(bool(w.visible(a, b)) == bool(expected[a, b]) for a in range(T) for b in range(T))  # ints too
    for s in range(T):
        assert w.first_key(s) == int(torch.nonzero(expected[s:].any(0)).min())
    assert w.binds(T) == (size < T) and not Window(T, kind).binds(T)
    assert w.label() == ("w" if kind == "sliding" else "c") + str(size)


def test_expand_pattern():
    """The pattern repeats from the first layer and is cut to n_layer; an empty one or a letter not L/G is refused."""
    assert expand_pattern("LLLG", 6) == "LLLGLL"
    assert expand_pattern("LLLG", 2) == "LL"
    assert expand_pattern("LLLG", 4) == "LLLG"
    assert expand_pattern("LG", 5) == "LGLGL"
    assert expand_pattern("G", 3) == "GGG"
    for bad in ("", "LLXG", "lg", "L G"):
        with pytest.raises(ValueError):
            expand_pattern(bad, 4)
    for bad in (0, 2.5, -1):
        with pytest.raises(ValueError):
            Window(bad)
    with pytest.raises(ValueError):
        Window(8, "strided")


# ---- 2. every kernel against a float64 attention ----------------------------------------------------------------


OPTIONS = {"nope": {}, "alibi": {}, "t5": {"num_buckets": 8, "max_distance": 20}, "kerple_log": {}, "sandwich": {},
           "fire": {"threshold": 8, "per_layer": False}, "cope": {"per_layer": False}}
WINDOWS = [None, Window(8), Window(16), Window(8, "chunked"), Window(12, "chunked")]
WINDOW_IDS = ["none", "w8", "w16", "c8", "c12"]


def make_scheme(name: str, T: int) -> PositionalScheme:
    """The scheme with a fixed draw of its parameters; CoPE's table (zeros at init) and npos = T + 1 randomised."""
    torch.manual_seed(11)
    scheme = build_scheme(name, H * DH, H, **OPTIONS[name], **({"npos": T + 1} if name == "cope" else {}))
    if name == "cope":
        with torch.no_grad():
            scheme.table.normal_(0.0, 0.7)
    return scheme


def pose_like(T: int) -> torch.Tensor:
    """Increasing positions with two gaps (as PoSE trains): 0…9, then +5, then +30."""
    pos = torch.arange(T)
    pos[10:] += 5
    pos[25:] += 30
    return pos


def reference(scheme, q, k, v, pos, window, sink):
    """softmax(q·kᵀ/√Dh + bias, hidden keys −inf [, sink]) · v in float64 on a float64 copy of the scheme; returns the
    output and the copy (whose parameters' gradients the caller may take)."""
    ref = copy.deepcopy(scheme).double()
    T = q.shape[2]
    seen = hf_visible(window, torch.arange(T)[:, None], torch.arange(T)[None, :])  # (T, T)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~seen, float("-inf"))  # (B, H, T, T)
    if scheme.contextual:  # CoPE: the bias of the masked scores (gates σ(−inf) = 0 outside the window)
        scores = scores + ref.contextual_bias(q, scores)
    else:
        scores = scores + ref.pair_bias(pos, pos, torch.float64)
    if sink is not None:
        column = sink[:, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.cat((scores, column), dim=-1).softmax(-1)[..., :T]
    else:
        probs = scores.softmax(-1)
    return probs @ v, ref


def kernels_to_force(scheme) -> list[str]:
    """The CPU kernels to force besides the context's choice (each one the context refuses is skipped)."""
    if scheme.contextual:
        return ["contextual"]
    return ["dense", "banded"] + (["folded"] if scheme.key_only_bias else []) + (["flex"] if FLEX else [])


def run_kernel(scheme, q, k, v, pos, window, sink, kernel, grad):
    """The context (as the model builds it: span T for positions 0…T−1) and attend's output."""
    span = pos.numel() if int(pos[-1] - pos[0]) == pos.numel() - 1 else None  # (the model's: T for 0…T−1)
    with torch.set_grad_enabled(grad):
        ctx = dispatch.context(scheme, pos, H, torch.float32, 0.0, kernel=kernel, span=span, window=window,
                                sink=sink is not None)
        return ctx, dispatch.attend(q, k, v, ctx, sink)


def check_kernels(name, T, window, with_sink, grad, pos) -> list[str]:
    """Random q, k, v (B = 2) and sink through the chosen kernel and each forced one the context accepts, against
    :func:`reference`: values, and with ``grad`` the gradients of Σ w·y for q, k, v, the sink and the scheme's
    parameters. Returns the kernels that ran (the chosen one first)."""
    scheme = make_scheme(name, T)
    g = torch.Generator().manual_seed(T + 7)
    q, k, v = (1.5 * torch.randn(2, H, T, DH, generator=g) for _ in range(3))
    sink = torch.tensor([0.5, 2.0, -1.0, 3.0]) if with_sink else None
    w = torch.randn(2, H, T, DH, generator=g)  # the loss's weights: Σ w·y
    leaves64 = [t.double().requires_grad_(grad) for t in (q, k, v)] + ([sink.double().requires_grad_(grad)] if with_sink
                                                                        else [])
    y_ref, ref = reference(scheme, *leaves64[:3], pos, window, leaves64[3] if with_sink else None)
    if grad:
        params64 = [p for p in ref.parameters() if p.requires_grad]
        want = torch.autograd.grad((y_ref * w.double()).sum(), leaves64 + params64, allow_unused=True)
    ran = []
    for kernel in [None, *kernels_to_force(scheme)]:
        if kernel == "flex" and (grad or with_sink):
            continue
        leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)] + ([sink.clone().requires_grad_(grad)]
                                                                         if with_sink else [])
        try:
            ctx, y = run_kernel(scheme, *leaves[:3], pos, window, leaves[3] if with_sink else None, kernel, grad)
        except ValueError:
            if kernel is None:
                raise
            continue  # a combination the context refuses
        ran.append(ctx.kernel)
        assert_close(y.double(), y_ref.detach(), **VALUES, msg=lambda m: f"{kernel or 'auto'} ({ctx.kernel}): {m}")
        if grad:
            params = [p for p in scheme.parameters() if p.requires_grad]
            got = torch.autograd.grad((y * w).sum(), leaves + params, allow_unused=True)
            tensors = leaves + params
            for a, b, t, what in zip(got, want, tensors, ["q", "k", "v", "sink"][: len(leaves)] + ["param"] * len(params)):
                a = torch.zeros_like(t) if a is None else a  # (unused: no gradient)
                b = torch.zeros_like(t, dtype=torch.float64) if b is None else b
                assert_close(a.double(), b, **GRADS, msg=lambda m: f"{kernel or 'auto'} ({ctx.kernel}), grad {what}: {m}")
    return ran


@pytest.mark.parametrize("grad", [False, True], ids=["eval", "grad"])
@pytest.mark.parametrize("with_sink", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("window", WINDOWS, ids=WINDOW_IDS)
@pytest.mark.parametrize("T", [37, 80])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_kernel_matches_float64_attention(name, T, window, with_sink, grad):
    """Positions 0…T−1: the chosen kernel and each one forced, values and gradients (q, k, v, sink, the scheme's)."""
    ran = check_kernels(name, T, window, with_sink, grad, torch.arange(T))
    assert len(ran) >= 2  # the choice and at least one forced kernel (dense, or contextual for CoPE)


@pytest.mark.parametrize("grad", [False, True], ids=["eval", "grad"])
@pytest.mark.parametrize("with_sink", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("window", WINDOWS, ids=WINDOW_IDS)
@pytest.mark.parametrize("name", ["alibi", "t5", "kerple_log", "fire"])
def test_every_kernel_with_gaps_in_the_positions(name, window, with_sink, grad):
    """Increasing positions with gaps (PoSE's): the bias follows the positions, the window the indices."""
    check_kernels(name, 37, window, with_sink, grad, pose_like(37))


@pytest.mark.parametrize("name", ["nope", "alibi", "t5"])
def test_window_kernel_choice_on_cpu(name):
    """A sliding window on CPU runs banded with and without gradients; a chunked one runs on its chunks (ctx.chunk)."""
    scheme, pos = make_scheme(name, 37), torch.arange(37)
    for grad in (False, True):
        for sink in (False, True):
            with torch.set_grad_enabled(grad):
                ctx = dispatch.context(scheme, pos, H, span=37, window=Window(8), sink=sink)
                assert (ctx.kernel, ctx.chunk) == ("banded", None), (grad, sink)
                for C in (8, 12):
                    ctx = dispatch.context(scheme, pos, H, span=37, window=Window(C, "chunked"), sink=sink)
                    assert ctx.chunk == C and ctx.window is None, (grad, sink, C)
    with torch.no_grad():  # a window as long as the sequence hides nothing: the causal choice of before
        assert dispatch.context(make_scheme("nope", 37), pos, H, span=37, window=Window(37)).kernel == "causal"


@pytest.mark.skipif(flex.flex_attention is None, reason="FlexAttention needs torch >= 2.5")
def test_flex_on_cpu_takes_both_windows(monkeypatch):
    """Compiled FlexAttention with the window's BlockMask (FIRE past its threshold: a bias of i and j), in the default
    suite (the broader forced-Flex cases above run with POSBENCH_TEST_FLEX=1): sliding and chunked, at T = 80."""
    monkeypatch.setattr(flex, "cpu_compiles", True)
    monkeypatch.setattr(dispatch, "dense", lambda *args: pytest.fail("the dense kernel ran instead of Flex"))
    scheme, T = make_scheme("fire", 80), 80
    g = torch.Generator().manual_seed(5)
    q, k, v = (1.5 * torch.randn(2, H, T, DH, generator=g) for _ in range(3))
    for window in (Window(16), Window(12, "chunked")):
        ctx, y = run_kernel(scheme, q, k, v, torch.arange(T), window, None, None, False)
        assert ctx.kernel == "flex" and ctx.window == window
        y_ref, _ = reference(scheme, q.double(), k.double(), v.double(), torch.arange(T), window, None)
        assert_close(y.double(), y_ref, **VALUES)


@pytest.mark.skipif(flex.flex_attention is None, reason="FlexAttention needs torch >= 2.5")
@pytest.mark.parametrize("window", [None, Window(8), Window(12, "chunked")], ids=["full", "sliding", "chunked"])
def test_flex_trains_a_sink_through_its_log_sum_exp(monkeypatch, window):
    """Flex as on CUDA, with gradients: its backward emulated on CPU (Flex's own math through aot_autograd, as
    tests/test_flex_tables.py does), the sink scaling the output by σ(lse − sink): values and the gradients of q, k,
    v and the sink against the float64 attention, for ALiBi with each window."""
    import torch.nn.attention.flex_attention as torch_flex

    monkeypatch.setattr(choice, "flex_backward", lambda device: True)
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *tensors: None)
    monkeypatch.setattr(flex, "_compiled", torch.compile(torch_flex.flex_attention, backend="aot_eager"))
    scheme, T = make_scheme("alibi", 40), 40
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, H, T, DH, generator=g).requires_grad_() for _ in range(3))
    sink = torch.tensor([0.5, 2.0, -1.0, 3.0], requires_grad=True)
    ctx, y = run_kernel(scheme, q, k, v, torch.arange(T), window, sink, "flex", True)
    assert ctx.kernel == "flex" and ctx.sink
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
    y_ref, _ = reference(scheme, *leaves[:3], torch.arange(T), window, leaves[3])
    assert_close(y.double(), y_ref.detach(), **VALUES)
    w = torch.randn(2, H, T, DH, generator=g)
    got = torch.autograd.grad((y * w).sum(), [q, k, v, sink])
    want = torch.autograd.grad((y_ref * w.double()).sum(), leaves)
    for a, b in zip(got, want):
        assert_close(a.double(), b, **GRADS)


@pytest.mark.skipif(flex.flex_attention is None, reason="FlexAttention needs torch >= 2.5")
def test_flex_on_cpu_pads_short_lengths(monkeypatch):
    """Below 128 tokens Flex on CPU runs on q, k, v padded to a multiple of 16 (``flex.cpu_padding``): torch 2.13's
    CPU kernel returned wrong values at T ≡ 8 (mod 16) there on this project's AMD EPYC. FIRE past its threshold at
    T = 24 and 40 against the float64 attention, and the padding itself."""
    assert [flex.cpu_padding(T) for T in (8, 24, 32, 40, 100, 127, 128, 136)] == [8, 8, 0, 8, 12, 1, 0, 0]
    monkeypatch.setattr(flex, "cpu_compiles", True)
    monkeypatch.setattr(dispatch, "dense", lambda *args: pytest.fail("the dense kernel ran instead of Flex"))
    for T in (24, 40):
        scheme = make_scheme("fire", T)
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(2, H, T, DH, generator=g) for _ in range(3))
        ctx, y = run_kernel(scheme, q, k, v, torch.arange(T), None, None, "flex", False)
        assert (ctx.kernel, ctx.pad) == ("flex", 8)
        y_ref, _ = reference(scheme, q.double(), k.double(), v.double(), torch.arange(T), None, None)
        assert_close(y.double(), y_ref, **VALUES)


def test_kernels_that_take_no_sink_or_window_refuse_them():
    """Flex on CPU has no log-sum-exp (no sink); folded shifts a sink's logit per query (neither sink nor window)."""
    alibi, pos = make_scheme("alibi", 37), torch.arange(37)
    with torch.no_grad():
        if flex.flex_attention is not None:
            with pytest.raises(ValueError):
                dispatch.context(alibi, pos, H, span=37, kernel="flex", sink=True)
        with pytest.raises(ValueError):
            dispatch.context(alibi, pos, H, span=37, kernel="folded", window=Window(8))
        with pytest.raises(ValueError):
            dispatch.context(alibi, pos, H, span=37, kernel="folded", sink=True)
        with pytest.raises(ValueError):
            dispatch.context(alibi, pos, H, span=37, kernel="folded", window=Window(8, "chunked"), sink=True)
        ctx = dispatch.context(alibi, pos, H, span=37)
        with pytest.raises(ValueError):  # causal takes no sliding window (a chunked one runs causal on its chunks)
            dispatch.context(make_scheme("nope", 37), pos, H, span=37, kernel="causal", window=Window(8))
        chunked = dispatch.context(make_scheme("nope", 37), pos, H, span=37, kernel="causal", window=Window(8, "chunked"))
        assert (chunked.kernel, chunked.chunk) == ("causal", 8)
    with pytest.raises(ValueError):  # causal with a sink: from SDPA's log-sum-exp, so only evaluating on CPU
        dispatch.context(make_scheme("nope", 37), pos, H, span=37, kernel="causal", sink=True)
    with pytest.raises(ValueError):  # a context without a sink, attend with one
        dispatch.attend(*(torch.randn(1, H, 37, DH) for _ in range(3)), ctx, torch.zeros(H))


# ---- 3. a one-layer windowed model sees its window only ---------------------------------------------------------


def tiny_spec(**model) -> dict:
    return {"vocab_size": 48, "model": {"n_layer": 1, "n_head": 2, "d_model": 16, "d_ff": 32, "dropout": 0.0, **model},
            "scheme": {"name": "rope"}}


@pytest.mark.parametrize("grad", [False, True], ids=["eval", "grad"])
@pytest.mark.parametrize("kind", ["sliding", "chunked"])
def test_one_local_layer_reads_only_its_window(kind, grad):
    """Changing the token at j changes the logits at i exactly when the window shows key j to query i."""
    W, T = 5, 23
    torch.manual_seed(3)
    model = build_model(tiny_spec(layer_pattern="L", window=W, window_kind=kind)).eval()
    idx = torch.randint(48, (1, T), generator=torch.Generator().manual_seed(4))
    with torch.set_grad_enabled(grad):
        base = model(idx)[0].detach()
        for j in range(T):
            other = idx.clone()
            other[0, j] = (idx[0, j] + 1) % 48
            change = (model(other)[0].detach() - base).abs().amax(-1)  # (T,)
            expected = hf_visible(Window(W, kind), torch.arange(T), torch.tensor(j))  # i sees j
            assert (change[expected] > 1e-5).all() and (change[~expected] == 0).all(), (j, change)


# ---- 4. the whole model against a float64 GPT ------------------------------------------------------------------


HYBRIDS = {
    "sliding": dict(layer_pattern="LLLG", window=8, window_kind="sliding", global_scheme={"name": "nope"},
                    qk_norm="rms", qk_norm_layers="all", qk_norm_weight=True, attn_sink=True),
    "chunked": dict(layer_pattern="LLLG", window=12, window_kind="chunked", global_scheme={"name": "nope"},
                    qk_norm="rms", qk_norm_layers="local", qk_norm_weight=False, attn_sink=True),
}
RMS_EPS = 1e-6  # QK-norm's RMSNorm epsilon (Gemma 3's, Qwen 3's)


def hybrid_model(which: str):
    torch.manual_seed(5)
    spec = {"vocab_size": 64, "model": {"n_layer": 4, "n_head": 2, "d_model": 32, "d_ff": 64, "dropout": 0.0,
                                        **HYBRIDS[which]}, "scheme": {"name": "rope"}}
    model = build_model(spec).eval()
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():  # gains and sinks away from their initial values, so that the test sees them
        for block in model.blocks:
            block.attn.sink.copy_(2.0 * torch.randn(2, generator=g))
            for norm in (block.attn.q_norm, block.attn.k_norm):
                if norm is not None and norm.weight is not None:
                    norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=g))
    return model


def hybrid_reference(model, which: str, idx: torch.Tensor) -> torch.Tensor:
    """tests/naive_gpt.py's float64 GPT with the layers of ``HYBRIDS[which]`` written out from its spec."""
    m = HYBRIDS[which]
    kinds = (m["layer_pattern"] * 4)[:4]
    dh = 16
    rope = 10000.0 ** (-torch.arange(0, dh, 2, dtype=torch.float64) / dh)  # RoFormer θ_i = 10000^(−2i/d)
    window = Window(m["window"], m["window_kind"])

    def visible(layer, T):
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        return hf_visible(window if kinds[layer] == "L" else None, i, j)

    def qk_norm(layer):
        if m["qk_norm_layers"] == "local" and kinds[layer] != "L":
            return None
        attn = model.blocks[layer].attn
        gains = (attn.q_norm.weight.double(), attn.k_norm.weight.double()) if m["qk_norm_weight"] else (None, None)
        return (*gains, RMS_EPS)

    return naive_logits(model, idx, inv_freq=lambda layer: rope if kinds[layer] == "L" else None, visible=visible,
                        sink=lambda layer: model.blocks[layer].attn.sink.double(), qk_norm=qk_norm)


@pytest.mark.parametrize("which", list(HYBRIDS))
def test_hybrid_model_matches_float64_gpt(which):
    """LLLG: RoPE local layers with a window, a NoPE global one, QK-norm and sinks; float64 tight, float32 loose,
    with gradients on (training kernels) and off."""
    model = hybrid_model(which)
    m = HYBRIDS[which]
    normed = ["L" in kind or m["qk_norm_layers"] == "all" for kind in "LLLG"]
    assert [b.attn.q_norm is not None for b in model.blocks] == normed
    assert all((b.attn.q_norm.weight is not None) == m["qk_norm_weight"] for b in model.blocks if b.attn.q_norm)
    idx = torch.randint(64, (1, 40), generator=torch.Generator().manual_seed(8))
    expected = hybrid_reference(model, which, idx[0])
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            assert_close(model(idx)[0].detach().double(), expected, atol=1e-4, rtol=1e-4)
    model64 = copy.deepcopy(model).double()
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            assert_close(model64(idx)[0].detach(), expected, atol=1e-9, rtol=1e-9)
    with torch.no_grad():  # the reference has power: the model without its sinks, or without its window, differs
        for block in model64.blocks:
            block.attn.sink.fill_(-30.0)
        assert (model64(idx)[0] - expected).abs().max() > 1e-3


# ---- 5. which scheme, window and parameters each layer gets -----------------------------------------------------


LOCAL = ["rope", "t5", "fire"]
GLOBAL = [{"name": "nope"}, {"name": "rope", "base": 1e6}, {"name": "fire"}]


def prefixes(model, root: str) -> set[str]:
    """The state-dict prefixes under ``root``: ``root.`` (shared) or ``root.<i>.`` (per layer)."""
    out = set()
    for key in model.state_dict():
        if key.startswith(root + "."):
            head = key[len(root) + 1:].split(".")[0]
            out.add(f"{root}.{head}." if head.isdigit() else f"{root}.")
    return out


@pytest.mark.parametrize("n_layer", [4, 6])
@pytest.mark.parametrize("glob", GLOBAL, ids=[g["name"] + str(len(g)) for g in GLOBAL])
@pytest.mark.parametrize("local", LOCAL)
def test_each_layer_gets_the_scheme_of_its_letter(local, glob, n_layer):
    """Classes follow the expanded pattern, windows only on L layers, one instance per layer for FIRE (per_layer)."""
    torch.manual_seed(0)
    spec = {"vocab_size": 32, "model": {"n_layer": n_layer, "n_head": 2, "d_model": 16, "d_ff": 32,
                                        "layer_pattern": "LLLG", "window": 8, "global_scheme": glob},
            "scheme": {"name": local}}
    model = build_model(spec)
    kinds = ("LLLG" * n_layer)[:n_layer]
    n_local, n_global = kinds.count("L"), kinds.count("G")
    classes = {"L": SCHEMES[local], "G": SCHEMES[glob["name"]]}
    assert [type(s) for s in model.layer_schemes] == [classes[c] for c in kinds]
    assert model.windows == [Window(8, "sliding") if c == "L" else None for c in kinds]
    for kind, name, root, count in (("L", local, "scheme", n_local), ("G", glob["name"], "global_scheme", n_global)):
        mine = [s for s, c in zip(model.layer_schemes, kinds) if c == kind]
        if name == "fire":  # per layer: layer i of that kind is root.<i>, each its own
            assert prefixes(model, root) == {f"{root}.{i}." for i in range(count)}
            assert all(s is model.get_submodule(f"{root}.{i}") for i, s in enumerate(mine))
            assert len({id(s) for s in mine}) == count
        else:
            assert prefixes(model, root) == ({f"{root}."} if name == "t5" else set())
            assert all(s is model.get_submodule(root) for s in mine)
    if glob["name"] == "rope":
        assert [s.config.base for s in model.layer_schemes if type(s) is SCHEMES["rope"]] == \
            [1e6 if c == "G" else 10000.0 for c in kinds if c == "G" or local == "rope"]


def test_layer_settings_that_do_not_fit_are_refused():
    """A global scheme without a G layer (LLLG at 2 layers) or without an L layer, a window without an L layer, and a
    scheme that embeds positions beside a global scheme (or as it) raise ValueError."""
    base = {"vocab_size": 32, "model": {"n_layer": 2, "n_head": 2, "d_model": 16, "d_ff": 32}, "scheme": {"name": "rope"}}
    model = build_model(base, {"model": {"layer_pattern": "LLLG", "window": 8}})  # LLLG at 2 layers: "LL"
    assert model.windows == [Window(8), Window(8)] and model.global_scheme is None
    refused = [
        {"model": {"layer_pattern": "LLLG", "global_scheme": {"name": "nope"}}},
        {"model": {"layer_pattern": "G", "global_scheme": {"name": "nope"}}},
        {"model": {"layer_pattern": "G", "window": 8}},
        {"model": {"layer_pattern": "LG", "global_scheme": {"name": "nope"}}, "scheme": {"name": "learned", "max_positions": 64}},
        {"model": {"layer_pattern": "LG", "global_scheme": {"name": "nope"}}, "scheme": {"name": "sinusoidal"}},
        {"model": {"layer_pattern": "LG", "global_scheme": {"name": "learned", "max_positions": 64}}},
        {"model": {"layer_pattern": "LXG"}},
        {"model": {"layer_pattern": ""}},
        {"model": {"layer_pattern": "LG", "window": 0}},
        {"model": {"layer_pattern": "LG", "window": 8, "window_kind": "strided"}},
        {"model": {"layer_pattern": "G", "qk_norm": "rms", "qk_norm_layers": "local"}},
    ]
    for overrides in refused:
        with pytest.raises(ValueError):
            build_model(base, overrides)


# ---- 6. the default model is the model of before ----------------------------------------------------------------


NEW_KEYS = {"layer_pattern": "G", "global_scheme": None, "window": None, "window_kind": "sliding", "qk_norm": "none",
            "qk_norm_layers": "all", "qk_norm_weight": True, "attn_sink": False}


@pytest.mark.parametrize("scheme", ["rope", "t5", "fire"])
def test_defaults_build_the_same_model(scheme):
    """No new key, and every new key at its default: identical state dicts and logits after the same seed; RoPE's
    logits are the float64 causal GPT's."""
    spec = {"vocab_size": 32, "model": {"n_layer": 2, "n_head": 2, "d_model": 16, "d_ff": 32, "dropout": 0.0},
            "scheme": {"name": scheme}}
    torch.manual_seed(1)
    plain = build_model(spec).eval()
    torch.manual_seed(1)
    spelled = build_model(spec, {"model": NEW_KEYS}).eval()
    a, b = plain.state_dict(), spelled.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[key], b[key]) for key in a)
    assert all(block.attn.sink is None and block.attn.q_norm is None for block in plain.blocks)
    assert plain.windows == [None, None] and plain.global_scheme is None
    idx = torch.randint(32, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(plain(idx), spelled(idx))
    if scheme == "rope":
        rope = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
        assert_close(plain.double()(idx)[1].detach(), naive_logits(plain, idx[1], inv_freq=rope), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("model", [{}, HYBRIDS["sliding"]], ids=["global", "hybrid"])
def test_sinks_are_drawn_last(model):
    """With attn_sink, every other parameter is the one the model without sinks draws after the same seed."""
    spec = {"vocab_size": 32, "model": {"n_layer": 4, "n_head": 2, "d_model": 16, "d_ff": 32, **model},
            "scheme": {"name": "fire"}}
    torch.manual_seed(9)
    without = build_model(spec, {"model": {"attn_sink": False}}).state_dict()
    torch.manual_seed(9)
    with_sinks = build_model(spec, {"model": {"attn_sink": True}}).state_dict()
    sinks = {key for key in with_sinks if key.endswith(".attn.sink")}
    assert sinks == {f"blocks.{i}.attn.sink" for i in range(4)}
    assert set(with_sinks) - sinks == set(without)
    assert all(torch.equal(with_sinks[key], without[key]) for key in without)
    drawn = torch.cat([with_sinks[key] for key in sorted(sinks)])
    assert (drawn != 0).all() and drawn.abs().max() < 0.12  # N(0, 0.02²)


# ---- 7. PoSE's positions -----------------------------------------------------------------------------------------


def chunks_of(pos: torch.Tensor, L: int, Lt: int, N: int) -> tuple[list[int], list[int]]:
    """Check one draw's shape and order; return the cut points (where the skip grows) and the skip of each token."""
    assert pos.dtype == torch.int64 and pos.shape == (L,)
    assert int(pos[0]) == 0 and (pos[1:] > pos[:-1]).all() and int(pos[-1]) < Lt
    skip = pos - torch.arange(L)  # u of each token's chunk: a step function from 0
    assert int(skip[0]) == 0 and (skip.diff() >= 0).all()
    cuts = (torch.nonzero(skip.diff()).flatten() + 1).tolist()
    assert len(cuts) <= N - 1
    return cuts, skip.tolist()


@pytest.mark.parametrize("L", [16, 17, 64, 128])
def test_pose_two_chunks_follow_the_paper(L):
    """N = 2: the first chunk is 1 … ⌈L/2⌉ tokens (each length occurs), u_1 in 0 … L_t − L, positions below L_t."""
    Lt, half = 16 * L, -(-L // 2)
    draws = 1500
    firsts, top = set(), 0
    for d in range(draws):
        cuts, skip = chunks_of(batches.pose_positions(d % 5, d, d % 3, Lt, L), L, Lt, 2)
        if cuts:
            assert 1 <= cuts[0] <= half
            firsts.add(cuts[0])
        assert 0 <= skip[-1] <= Lt - L
        top = max(top, skip[-1])
    assert firsts == set(range(1, half + 1))
    assert top > 0.98 * (Lt - L)


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


def test_pose_draws_are_uniform():
    """L = 16, L_t = 256, 6000 draws: u_1 takes both ends 0 and L_t − L; u_1 (8 coarse bins) and the first chunk's
    length pass a χ² test of uniformity (7 degrees of freedom, 24.3: p = 0.001)."""
    L, Lt, draws = 16, 256, 6000
    top = Lt - L
    skips, firsts = [0] * 8, [0] * 8
    ends = set()
    for d in range(draws):
        pos = batches.pose_positions(7, d, 0, Lt, L)
        u = int(pos[-1]) - (L - 1)
        ends |= {u} & {0, top}
        skips[u * 8 // (top + 1)] += 1
        cut = next((t for t in range(1, L) if pos[t] != pos[t - 1] + 1), None)
        if cut is not None:
            firsts[cut - 1] += 1
    assert ends == {0, top}
    width = [sum(1 for u in range(top + 1) if u * 8 // (top + 1) == b) for b in range(8)]
    assert chi_square(skips, [w / (top + 1) for w in width]) < 24.3
    assert chi_square(firsts, [1 / 8] * 8) < 24.3


@pytest.mark.parametrize("L", [16, 64])
def test_pose_three_chunks(L):
    """N = 3: at most two cuts (two where both skips grow), skips non-decreasing and ≤ L_t − L, cuts over 1 … L − 1."""
    Lt = 16 * L
    two, cut_points = 0, set()
    for d in range(800):
        cuts, skip = chunks_of(batches.pose_positions(1, d, 0, Lt, L, chunks=3), L, Lt, 3)
        assert skip[-1] <= Lt - L
        two += len(cuts) == 2
        cut_points |= set(cuts)
    assert two > 700  # both skips grow but where one draw repeats the last (probability ~ 2/(L_t − L))
    assert min(cut_points) == 1 and max(cut_points) == L - 1


def test_pose_positions_are_reproducible():
    """The same (seed, step, rank) draws the same positions; another step, rank or seed others."""
    draw = batches.pose_positions(3, 5, 0, 2048, 128)
    assert torch.equal(draw, batches.pose_positions(3, 5, 0, 2048, 128))
    for other in ((3, 6, 0), (3, 5, 1), (4, 5, 0)):
        assert not torch.equal(draw, batches.pose_positions(*other, 2048, 128)), other


# ---- 8. labels -------------------------------------------------------------------------------------------------


def config(model: dict | None = None, train: dict | None = None) -> dict:
    return {"scheme": {"name": "rope"}, "model": model or {}, "train": {"seq_len": 128, **(train or {})}}


LABELS = [
    (dict(layer_pattern="LLLG", window=32, global_scheme={"name": "nope"}), {}, "rope+LLLG(w32, G=nope)"),
    (dict(layer_pattern="LLLG", window=32, window_kind="chunked", global_scheme={"name": "nope"}, qk_norm="rms",
          qk_norm_weight=False, qk_norm_layers="local"), {}, "rope+LLLG(c32, G=nope, qknorm0-L)"),
    (dict(layer_pattern="LG", window=32, attn_sink=True), {}, "rope+LG(w32, sink)"),
    (dict(layer_pattern="LLLG", window=32, global_scheme={"name": "rope", "base": 1e6}), {},
     "rope+LLLG(w32, G=rope[base=1e+06])"),
    (dict(qk_norm="rms", attn_sink=True), {}, "rope+qknorm+sink"),
    ({}, {"pose": 2048}, "rope+pose2048"),
    ({}, {"pose": 2048, "pose_chunks": 3}, "rope+pose2048n3"),
    ({}, {}, "rope"),
    (NEW_KEYS, {"pose": None, "pose_chunks": 2}, "rope"),
]


@pytest.mark.parametrize("model, train, label", LABELS, ids=[label for _, _, label in LABELS])
def test_run_labels(model, train, label):
    assert results.run_label(config(model, train)) == label
    assert results.layers_label(config(model, train)) + results.tricks_label(config(model, train)) == label[len("rope"):]


def test_file_labels_of_hybrids():
    """A hybrid's label as a file name: no brackets, commas, spaces or '='; two designs stay two names."""
    names = [results.file_label(label) for _, _, label in LABELS[:5]]
    for name in names:
        assert not set(name) & set("()[], ="), name
    assert len(set(names)) == len(names)
    assert not set(results.file_label("rope+LLLG(c32, G=nope, qknorm0-L)")) & set("(), =")


# ---- 9. memory --------------------------------------------------------------------------------------------------


def memory_spec(**model) -> dict:
    return {"vocab_size": 64, "model": {"n_layer": 4, "n_head": 4, "d_model": 64, "d_ff": 128, **model},
            "scheme": {"name": "rope"}}


@pytest.mark.parametrize("kind", ["sliding", "chunked"])
def test_windowed_attention_memory_is_linear_in_length(kind):
    """A local layer with a window of 32: its attention memory grows by the same amount per doubling of T."""
    spec = memory_spec(n_layer=1, layer_pattern="L", window=32, window_kind=kind)
    size = {T: memory.step_bytes(spec, 1, T, None, training=False, device="cpu")["attention"] for T in (2048, 4096, 8192)}
    assert size[8192] <= 4.5 * size[2048]
    assert size[8192] - size[4096] == pytest.approx(2 * (size[4096] - size[2048]), rel=0.05)


def test_layer_kernels_of_hybrids():
    """LLLG w32 with a NoPE global layer: banded RoPE layers in CPU training and causal NoPE; chunked c32: causal on
    chunks of 32."""
    RoPE, NoPE = SCHEMES["rope"], SCHEMES["nope"]
    spec = memory_spec(layer_pattern="LLLG", window=32, global_scheme={"name": "nope"})
    assert memory.layer_kernels(spec, "cpu", True) == [("banded", None, RoPE)] * 3 + [("causal", None, NoPE)]
    chunked = memory_spec(layer_pattern="LLLG", window=32, window_kind="chunked", global_scheme={"name": "nope"})
    assert memory.layer_kernels(chunked, "cpu", True) == [("causal", 32, RoPE)] * 3 + [("causal", None, NoPE)]
    assert NoPE is PositionalScheme
