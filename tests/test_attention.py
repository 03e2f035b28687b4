"""posbench.attention.dispatch: every kernel against a naive float64 softmax attention written here.

The reference computes the scores q·kᵀ/√Dh, adds the bias of the scheme's paper computed here (ALiBi:
−m_h·(i − j), Press et al. 2022 §3, m_h = 2^(−8h/H) for H a power of two; the learned toy: −w_h·(i − j)),
rotates q and k first for RoPE (pairs (i, i + Dh/2) turned by p·base^(−2i/Dh), Su et al. 2021), masks every
key after its query by index, softmaxes and multiplies by v, all in float64.

Kernels: ``causal`` (SDPA is_causal), ``folded`` (a key-only bias as one extra head dimension), ``dense``
(float-mask query blocks) and ``flex`` (FlexAttention compiled on CPU, evaluation only; skipped with the reason
where it cannot compile). L = 16 stands for the train length; windows of L and 8L, also cut into many small
blocks, and one of 8192 positions for the precision of the folded kernel far from a block's reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.testing import assert_close

from posbench.attention import blockwise, choice, dense, dispatch, flex
from posbench.model.build import build_model
from posbench.schemes import SCHEMES, PositionalScheme, build_scheme

L = 16
H, DH = 4, 8
# the schemes whose bias this file's reference writes out; the relative biases (posbench/t5_kerple.py,
# posbench/sandwich_fire.py) are checked against their papers' formulas, through every kernel, in tests/test_relative.py
OWN = sorted({"nope", "sinusoidal", "learned", "rope", "alibi"} & set(SCHEMES))
TOL = dict(atol=2e-5, rtol=1e-4)


class LinearBias(PositionalScheme):
    """A learned toy: score(i, j) += −w_h · (i − j), one trained slope per head (ALiBi with learned slopes)."""

    has_bias = True
    key_only_bias = True

    def __init__(self, d_model, n_head, config=None):
        super().__init__(d_model, n_head, config)
        self.w = nn.Parameter(torch.linspace(0.05, 0.6, n_head))

    def score_mod(self, score, h, q_pos, k_pos):
        return score - self.w[h] * (q_pos - k_pos)


class LinearBiasDense(LinearBias):
    """The same bias, not declared key-only: the kernel must build it densely."""

    key_only_bias = False


def make_scheme(name: str) -> PositionalScheme:
    if name == "toy":
        return LinearBias(H * DH, H)
    if name == "toy-dense":
        return LinearBiasDense(H * DH, H)
    return build_scheme(name, H * DH, H, **({"max_positions": 1 << 17} if name == "learned" else {}))


# ---- the float64 reference, from the papers' formulas ----------------------------------------------------


def paper_bias(name: str, scheme, pos: torch.Tensor) -> torch.Tensor:
    """(H, T, T) float64 (or a zero): the additive score bias of query i and key j at positions pos[i], pos[j]."""
    i, j = pos[:, None].double(), pos[None, :].double()
    if name == "alibi":
        slopes = torch.tensor([2.0 ** (-8.0 * h / H) for h in range(1, H + 1)], dtype=torch.float64)
    elif name.startswith("toy"):
        slopes = scheme.w.double()  # keeps the graph: gradients reach w
    else:
        return torch.zeros((), dtype=torch.float64)
    return -slopes[:, None, None] * (i - j)  # (H, T, T)


def paper_rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """x (B, H, T, Dh) float64, pair (i, i + Dh/2) turned by angle pos·base^(−2i/Dh)."""
    half = x.shape[-1] // 2
    angle = pos.double()[:, None] * base ** (-2.0 * torch.arange(half, dtype=torch.float64) / x.shape[-1])  # (T, Dh/2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()), dim=-1)


def paper_xpos(x: torch.Tensor, pos: torch.Tensor, query: bool, gamma: float = 0.4, scale_base: float = 512.0):
    """xPos (Sun et al. 2022): RoPE's turn, then pair i scaled by ζ_i^(±(p − c)/scale_base), ζ_i = (i/(Dh/2) + γ)/(1 + γ),
    + for queries, − for keys, c the middle of the positions (a score depends on n − m only)."""
    half = x.shape[-1] // 2
    zeta = (torch.arange(half, dtype=torch.float64) / half + gamma) / (1 + gamma)
    p = pos.double()
    scale = zeta ** ((p - (p.min() + p.max()) / 2)[:, None] / scale_base * (1 if query else -1))  # (T, Dh/2)
    return paper_rope(x, pos) * torch.cat((scale, scale), dim=-1)


def reference(name, scheme, q, k, v, pos, rows=None):
    """softmax(q·kᵀ/√Dh + bias, keys after the query masked by index) · v in float64 → (B, H, R, Dh), for the
    query indices ``rows`` (all by default)."""
    q, k, v = q.double(), k.double(), v.double()
    if name == "rope":
        q, k = paper_rope(q, pos), paper_rope(k, pos)
    elif name == "xpos":
        q, k = paper_xpos(q, pos, True), paper_xpos(k, pos, False)
    T = q.shape[2]
    rows = torch.arange(T) if rows is None else rows
    scores = q[:, :, rows] @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, R, T)
    bias = paper_bias(name, scheme, pos)
    scores = scores + (bias[:, rows] if bias.dim() else bias)
    future = torch.arange(T)[None, :] > rows[:, None]  # (R, T): key index after query index
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def run(scheme, q, k, v, pos, kernel=None):
    """The kernel's attention: context once, the scheme's rotation, then attend."""
    ctx = dispatch.context(scheme, pos, H, q.dtype, kernel=kernel)
    q, k = scheme.rotate(q, k, ctx.rotation)
    return dispatch.attend(q, k, v, ctx)


def qkv(T: int, B: int = 2, Dh: int = DH, seed: int = 0, scale: float = 1.5):
    """Random q, k, v (B, H, T, Dh) float32, large enough for sharp attention (a stronger test)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(scale * torch.randn(B, H, T, Dh, generator=g) for _ in range(3))


def kernels_of(name: str) -> list[str | None]:
    """The kernels that apply to a scheme here without compiling (None: the one the context chooses)."""
    scheme = make_scheme(name)
    auto = choice.choose_kernel(scheme, torch.device("cpu"), torch.float32, 0.0, grad=False)
    return ([None] if auto != "flex" else []) + ["dense"] + (["folded"] if scheme.key_only_bias else []) + \
        ([] if scheme.has_bias else ["causal"])


CASES = [(name, kernel) for name in [*OWN, "toy", "toy-dense"] for kernel in kernels_of(name)]
IDS = [f"{name}-{kernel or 'auto'}" for name, kernel in CASES]


@pytest.fixture
def small_blocks(monkeypatch):
    """Folded blocks of 5 queries and dense blocks of 7 (for H heads and T keys): many blocks, a ragged last one."""
    def set_for(T):
        monkeypatch.setattr(blockwise, "FOLD_QUERIES", 5)
        monkeypatch.setattr(dense, "BIAS_ELEMENTS", H * T * 7)
    return set_for


# ---- every kernel equals the reference ----------------------------------------------------------------


@pytest.mark.parametrize("blocks", ["one-block", "small-blocks"])
@pytest.mark.parametrize("offset", [0, 1000])
@pytest.mark.parametrize("T", [L, 8 * L], ids=["L", "8L"])
@pytest.mark.parametrize("name, kernel", CASES, ids=IDS)
def test_kernel_matches_float64_reference(name, kernel, T, offset, blocks, small_blocks):
    if blocks == "small-blocks":
        small_blocks(T)
    scheme = make_scheme(name)
    q, k, v = qkv(T, seed=T + offset)
    pos = torch.arange(T) + offset
    with torch.no_grad():
        y = run(scheme, q, k, v, pos, kernel)
        assert y.shape == q.shape and y.dtype == q.dtype
        assert_close(y.double(), reference(name, scheme, q, k, v, pos), **TOL)


@pytest.mark.parametrize("kernel", ["folded", "banded"])
@pytest.mark.parametrize("offset", [0, 100_000])
def test_alibi_is_precise_at_8192_positions(offset, kernel):
    """Far from the reference position a folded bias loses fp32 precision; the blocks keep it: within the
    reference's tolerance for query rows at the start, the block edges, the middle and the end of 8192 tokens.
    The same rows through the banded kernel, which evaluates ALiBi by default (its mask per distance)."""
    T = 8192
    scheme = make_scheme("alibi")
    q, k, v = qkv(T, B=1, Dh=32, seed=1, scale=0.6)
    pos = torch.arange(T) + offset
    rows = torch.tensor([0, 1, 255, 256, 300, 4095, 4096, 4200, T - 257, T - 2, T - 1])
    with torch.no_grad():
        ctx = dispatch.context(scheme, pos, H, kernel=None if kernel == "banded" else kernel)
        y = dispatch.attend(q, k, v, ctx)
    assert ctx.kernel == kernel and len(ctx.blocks) == T // blockwise.FOLD_QUERIES
    assert_close(y[:, :, rows].double(), reference("alibi", scheme, q, k, v, pos, rows), **TOL)


# ---- causal by index -----------------------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["increasing", "reversed"])
@pytest.mark.parametrize("name, kernel", [c for c in CASES if c[0] in ("alibi", "rope", "toy-dense")],
                         ids=[i for c, i in zip(CASES, IDS) if c[0] in ("alibi", "rope", "toy-dense")])
def test_changing_a_later_key_leaves_earlier_outputs_unchanged(name, kernel, positions, small_blocks):
    T = 8 * L
    small_blocks(T)
    scheme = make_scheme(name)
    q, k, v = qkv(T, seed=2)
    pos = torch.arange(T) * 3 + 7
    if positions == "reversed":  # causality is by index, whatever the positions say
        pos = pos.flip(0)
    with torch.no_grad():
        base = run(scheme, q, k, v, pos, kernel)
        for t in (0, 4, 5, 6, T // 2, T - 2):
            k2, v2 = k.clone(), v.clone()
            k2[:, :, t + 1:] += 1.0
            v2[:, :, t + 1:] -= 2.0
            out = run(scheme, q, k2, v2, pos, kernel)
            assert_close(out[:, :, : t + 1], base[:, :, : t + 1], msg=lambda m: f"index <= {t} saw a later key: {m}")
            if positions == "increasing":  # (reversed, a far key's bias grows without bound: the change is drowned)
                assert not torch.allclose(out[:, :, t + 1], base[:, :, t + 1])  # the change itself is seen


# ---- memory: no (T, T) tensor, blocks within their budget ------------------------------------------------


class LargestTensor(TorchFunctionMode):
    """Records the element count of the largest tensor any torch function returns while active."""

    def __init__(self):
        super().__init__()
        self.largest, self.shape = 0, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.shape = t.numel(), tuple(t.shape)
        return out


@pytest.mark.parametrize("kernel", ["dense", "folded"])
def test_memory_stays_bounded_at_a_long_window(kernel, monkeypatch):
    """At 4096 tokens no intermediate (context and attention, SDPA restricted to its fused kernel, which keeps
    no score matrix) has more elements than max(bias budget, the padded q/k/v): far below T² = 16.8 M."""
    T, B = 4096, 1
    monkeypatch.setattr(dense, "BIAS_ELEMENTS", H * T * 64)  # dense: blocks of 64 queries
    scheme = make_scheme("alibi")
    q, k, v = qkv(T, B=B, seed=3)
    pos = torch.arange(T)
    spy = LargestTensor()
    shapes = []
    real_dense_mask = blockwise.dense_mask

    def dense_mask(*args):
        mask = real_dense_mask(*args)
        shapes.append(mask.shape)
        return mask

    monkeypatch.setattr(blockwise, "dense_mask", dense_mask)
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION), spy:
        y = run(scheme, q, k, v, pos, kernel)
    bound = max(dense.BIAS_ELEMENTS, blockwise.FOLD_QUERIES * (T + blockwise.FOLD_QUERIES), B * H * T * (DH + 1))
    assert spy.largest <= bound, f"largest intermediate {spy.shape}"
    assert spy.largest * 8 < T * T  # linear in T (Q · T at most), not quadratic
    if kernel == "dense":
        assert len(shapes) == math.ceil(T / 64) and all(math.prod(s) <= dense.BIAS_ELEMENTS for s in shapes)
    rows = torch.tensor([0, 17, 2000, T - 1])
    assert_close(y[:, :, rows].double(), reference("alibi", scheme, q, k, v, pos, rows), **TOL)


# ---- gradients of a learned bias -------------------------------------------------------------------------


@pytest.mark.parametrize("blocks", ["one-block", "small-blocks"])
@pytest.mark.parametrize("name, kernel", [("toy-dense", None), ("toy-dense", "dense"), ("toy", None), ("toy", "folded")])
def test_learned_bias_gets_the_reference_gradients(name, kernel, blocks, small_blocks):
    """d(loss)/d(q, k, v, w) through the kernel equal those of the float64 reference (torch.autograd)."""
    T = 2 * L + 3
    if blocks == "small-blocks":
        small_blocks(T)
    scheme = make_scheme(name)
    q, k, v = (t.requires_grad_() for t in qkv(T, seed=4))
    pos = torch.arange(T) + 11
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (run(scheme, q, k, v, pos, kernel).double() * weight).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)] + [scheme.w.grad.clone()]
    for t in (q, k, v, scheme.w):
        t.grad = None
    (reference(name, scheme, q, k, v, pos) * weight).sum().backward()
    want = [t.grad for t in (q, k, v)] + [scheme.w.grad]
    for g, w_, what in zip(got, want, ["q", "k", "v", "w"]):
        assert g.abs().sum() > 0, what
        assert_close(g.double(), w_.double(), atol=1e-4, rtol=1e-4, msg=lambda m: f"d/d{what}: {m}")


# ---- FlexAttention on CPU (evaluation only) --------------------------------------------------------------


@pytest.fixture(scope="module")
def flex_cpu():
    """Skips unless compiled FlexAttention runs on this CPU (it needs torch >= 2.5 and a C++ compiler)."""
    if flex.flex_attention is None:
        pytest.skip("torch.nn.attention.flex_attention is missing (torch < 2.5)")
    scheme = make_scheme("alibi")
    q, k, v = qkv(L, B=1, seed=6)
    try:
        with torch.no_grad():
            run(scheme, q, k, v, torch.arange(L), "flex")
    except Exception as err:  # noqa: BLE001 - any compiler failure means: not here
        pytest.skip(f"compiled FlexAttention does not run on this CPU: {type(err).__name__}: {str(err)[:200]}")


FLEX_CASES = [(name, 8 * L) for name in [*OWN, "toy-dense"]] + [("alibi", L), ("toy-dense", L)]


@pytest.mark.parametrize("name, T", FLEX_CASES, ids=[f"{name}-{T // L}L" for name, T in FLEX_CASES])
def test_flex_on_cpu_matches_float64_reference(name, T, flex_cpu):
    """Every scheme at 8L, the bias schemes at L too (each case compiles: a few seconds)."""
    scheme = make_scheme(name)
    q, k, v = qkv(T, seed=7)
    pos = torch.arange(T) + 5
    with torch.no_grad():
        y = run(scheme, q, k, v, pos, "flex")
    assert_close(y.double(), reference(name, scheme, q, k, v, pos), **TOL)


def test_flex_refuses_a_backward_on_cpu():
    with pytest.raises(ValueError, match="FlexAttention"):
        dispatch.context(make_scheme("alibi"), torch.arange(L), H, kernel="flex")


# ---- which kernel, chosen from class attributes -----------------------------------------------------------


@pytest.mark.parametrize("name", OWN)
def test_kernel_is_chosen_from_class_attributes_without_probing(name, monkeypatch):
    scheme = make_scheme(name)
    if not type(scheme).has_bias:  # a probe of score_mod would fail here
        monkeypatch.setattr(scheme, "score_mod", lambda *a: pytest.fail("score_mod was called for a scheme without bias"))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    train, evaluate = {"alibi": ("folded", "banded")}.get(name, ("causal", "causal"))  # ALiBi: −m·(i − j) as a table
    assert choice.choose_kernel(scheme, cpu, torch.float32, 0.0, True) == train
    assert choice.choose_kernel(scheme, cpu, torch.float32, 0.0, False) == evaluate
    assert dispatch.context(scheme, torch.arange(L), H).kernel == train  # (gradients on here)
    with torch.no_grad():
        assert dispatch.context(scheme, torch.arange(L), H).kernel == evaluate
        assert dispatch.context(scheme, torch.arange(L).flip(0), H).kernel == train  # banded needs increasing ones
    with torch.no_grad():
        run(scheme, *qkv(L), torch.arange(L))
    monkeypatch.setattr(flex, "cpu_compiles", True)
    fused = "flex" if flex.flex_attention is not None else "dense"
    if type(scheme).has_bias:
        assert choice.choose_kernel(scheme, cuda, torch.bfloat16, 0.0, True) == fused  # training and evaluation
        assert choice.choose_kernel(scheme, cuda, torch.bfloat16, 0.1, True) == "dense"  # Flex has no dropout
        assert choice.choose_kernel(scheme, cpu, torch.bfloat16, 0.0, True) == "dense"  # no fold in 8-bit mantissas
    not_key_only = LinearBiasDense(H * DH, H)  # CPU: Flex evaluates it (measured faster than dense), dense trains it
    assert choice.choose_kernel(not_key_only, cpu, torch.float32, 0.0, False) == fused
    assert choice.choose_kernel(not_key_only, cpu, torch.float32, 0.0, True) == "dense"
    monkeypatch.setattr(flex, "cpu_compiles", False)  # Flex failed to compile here before
    assert choice.choose_kernel(not_key_only, cpu, torch.float32, 0.0, False) == "dense"
    with pytest.raises(ValueError):
        dispatch.context(not_key_only, torch.arange(L), H, kernel="folded")
    with pytest.raises(ValueError):
        dispatch.context(scheme, torch.arange(L), H, kernel="sparse")


@pytest.mark.parametrize("name", ["rope", "alibi"])
def test_positions_are_prepared_once_per_forward(name, monkeypatch):
    """RoPE's tables and ALiBi's bias are computed once per forward pass, not in every layer."""
    torch.manual_seed(0)
    spec = {"vocab_size": 61, "model": {"n_layer": 3, "n_head": H, "d_model": H * DH, "d_ff": 64}, "scheme": {"name": name}}
    model = build_model(spec).eval()
    calls = {"rotation": 0, "score_mod": 0}
    for hook in calls:
        real = getattr(model.scheme, hook)

        def spy(*a, hook=hook, real=real):
            calls[hook] += 1
            return real(*a)

        monkeypatch.setattr(model.scheme, hook, spy)
    with torch.no_grad():
        model(torch.randint(0, 61, (2, 3 * L)))
    assert calls["rotation"] == 1
    assert calls["score_mod"] == (1 if name == "alibi" else 0)  # one block of 48 ≤ FOLD_QUERIES queries


def test_flex_that_fails_to_compile_on_cpu_falls_back_to_dense(monkeypatch, caplog):
    """Where compiled Flex cannot run on this CPU (no C++ compiler, …), the dense kernel answers, with a warning
    naming the reason, and later contexts choose dense directly."""
    if flex.flex_attention is None:
        pytest.skip("torch.nn.attention.flex_attention is missing (torch < 2.5)")

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(flex, "_compiled", broken)
    monkeypatch.setattr(flex, "cpu_compiles", True)
    scheme = make_scheme("toy-dense")
    q, k, v = qkv(L, seed=8)
    pos = torch.arange(L)
    with torch.no_grad(), caplog.at_level("WARNING", logger="posbench"):
        assert dispatch.context(scheme, pos, H).kernel == "flex"
        y = run(scheme, q, k, v, pos)
        assert dispatch.context(scheme, pos, H).kernel == "dense"
    assert "no C++ compiler found" in caplog.text
    assert_close(y.double(), reference("toy-dense", scheme, q, k, v, pos), **TOL)


# ---- one predicate for SDPA's fused CPU kernel; a scheme's own dense block height -----------------------------------


def test_one_predicate_says_where_the_fused_cpu_kernel_runs(monkeypatch):
    """``blockwise.fused_cpu`` (CPU, float32/float64, torch's fused kernel present) is what the kernel choice and the
    remap kernel both ask: where it says no, neither the banded kernel nor the remap's fused plan is chosen."""
    from posbench.attention import remap_kernel
    from posbench.attention.remap import Remap

    cpu = torch.device("cpu")
    assert blockwise.fused_cpu(torch.float32, cpu) and blockwise.fused_cpu(torch.float64, cpu)
    assert not blockwise.fused_cpu(torch.bfloat16, cpu) and not blockwise.fused_cpu(torch.float32, torch.device("cuda"))
    scheme, rerope = make_scheme("t5"), Remap("rerope", window=4)
    remap_kernel.fused_plan.cache_clear()
    assert choice.choose_kernel(scheme, cpu, torch.float32, 0.0, False) == "banded"
    assert remap_kernel.prepare(scheme, rerope, 4 * L, torch.float32, cpu).plan is not None
    monkeypatch.setattr(blockwise, "fused_cpu", lambda dtype, device: False)
    assert choice.choose_kernel(scheme, cpu, torch.float32, 0.0, False) not in ("banded", "causal")
    assert remap_kernel.prepare(scheme, rerope, 4 * L, torch.float32, cpu).plan is None


class Rows(PositionalScheme):
    """A bias of i and j (not of i − j alone: −0.1·(h + 1)·(i − j) + 0.01·i) whose ``dense_rows`` asks for blocks of
    3 queries on CPU without gradients: FIRE's hook, on a scheme the kernels know nothing else of."""

    has_bias = True

    @classmethod
    def dense_rows(cls, grad, device):
        return 3 if not grad and device.type == "cpu" else None

    def score_mod(self, score, h, q_pos, k_pos):
        return score - 0.1 * (h + 1) * (q_pos - k_pos) + 0.01 * q_pos


def test_a_schemes_own_dense_rows_set_the_dense_kernels_blocks():
    """Evaluated on CPU, a scheme whose ``dense_rows`` gives 3 runs the dense kernel in blocks of 3 queries, each
    block's mask built as the layer runs it (none kept in the context), and attends as the naive softmax with its bias
    does; with gradients it gives None and the blocks are the budget's again."""
    scheme, T = Rows(H * DH, H), 10
    q, k, v = qkv(T, seed=4)
    with torch.no_grad():
        ctx = dispatch.context(scheme, torch.arange(T), H)
        assert ctx.kernel == "dense" and ctx.blocks == [(0, 3), (3, 6), (6, 9), (9, 10)] and ctx.masks is None
        y = dispatch.attend(q, k, v, ctx)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    bias = torch.stack([-0.1 * (h + 1) * (i - j) + 0.01 * i for h in range(H)]).to(q.dtype)  # (H, T, T)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(DH) + bias
    expect = scores.masked_fill(j > i, float("-inf")).softmax(-1) @ v
    assert_close(y, expect, **TOL)
    assert dispatch.context(scheme, torch.arange(T), H).blocks == dense.dense_blocks(T, H)  # (gradients on)
