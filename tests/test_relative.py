"""posbench.t5_kerple and posbench.sandwich_fire: the T5, KERPLE (log, power), Sandwich and FIRE biases against
their papers' formulas.

Each formula is written here again, from the paper (and, where the paper leaves a detail to its code, from that
code's description), independently of posbench/t5_kerple.py and posbench/sandwich_fire.py: once as Python loops
over i, j and h in float64 (the bias itself), once as float64 tensors (the attention reference, which also carries
gradients):

* t5            w[bucket(i − j), h]; bucket: n = max(i − j, 0); n if n < B/2, else
                B/2 + ⌊log(n/(B/2)) / log(M/(B/2)) · (B − B/2)⌋ capped at B − 1 (Raffel et al. 2020 §2.1, T5 code)
* kerple_log    −r₁·log(1 + r₂·|i − j|), r = softplus(θ) (Chi et al. 2022 §4)
* kerple_power  −r₁·|i − j|^r₂, r₁ = softplus(θ₁), r₂ = 2·sigmoid(θ₂)
* sandwich      (Σ_{k=1}^{d̄/2} cos((i − j)/10000^(2k/d̄)) − d̄/2) / (8h/H), h = 1 … H (Chi et al. 2023 §5)
* fire          f_θ(ψ(i − j) / (ψ(max(|m·L₀|, i)) + 1e-6)), ψ(x) = log(|c·x| + 1), f_θ a 1 → W → H ReLU MLP
                (Li et al. 2024 §3.2 and its appendix code)

Checked: the scheme's bias (dense broadcast calls and FlexAttention-style 0-d calls) equals the loops; the
attention output, through the kernel the model picks and the dense kernel, equals a float64 softmax attention
at L and 4L; causality; translation invariance (not FIRE, which depends on i); gradients of the learned
parameters (equal to the reference's, and non-zero and finite through a model's loss); checkpoint round trips;
Config checks; and Hydra composition of ``posbench train scheme=<name> debug=fast``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_module
from torch.testing import assert_close

from helpers import paper_bias, t5_bucket_by_hand
from posbench import cli
from posbench.attention import blockwise, choice, dispatch
from posbench.config.checks import ConfigError
from posbench.config.schema import finalize, to_dict
from posbench.model import build
from posbench.schemes import SCHEMES, build_scheme

NAMES = ["t5", "kerple_log", "kerple_power", "sandwich", "fire"]
LEARNED = ["t5", "kerple_log", "kerple_power", "fire"]
INVARIANT = ["t5", "kerple_log", "kerple_power", "sandwich"]
L = 16  # stands for the train length (FIRE's threshold)
H, DH = 4, 8
TOL = dict(atol=2e-5, rtol=1e-4)
VOCAB = 53


def make_scheme(name: str, **options):
    torch.manual_seed(3)
    if name == "fire":
        options.setdefault("threshold", L)
    if name == "sandwich":
        options.setdefault("dim", 16)  # a code wider than the head (8): more terms to get right
    return build_scheme(name, H * DH, H, **options)


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---- the papers' formulas: Python loops (float64) ------------------------------------------------------


def loop_bias(name: str, scheme, pos: torch.Tensor) -> torch.Tensor:
    """(H, T, T) float64: b(h, i, j) for query position pos[a] and key position pos[b], b <= a (NaN above)."""
    T = len(pos)
    out = torch.full((H, T, T), float("nan"), dtype=torch.float64)
    p = [int(x) for x in pos]
    with torch.no_grad():
        for a in range(T):
            for b in range(a + 1):
                i, j = p[a], p[b]
                for h in range(H):
                    out[h, a, b] = loop_value(name, scheme, h, i, j)
    return out


def loop_value(name, s, h, i, j) -> float:
    if name == "t5":
        B, M = s.config.num_buckets, s.config.max_distance
        return float(s.weight[t5_bucket_by_hand(i - j, B, M), h])
    if name == "kerple_log":
        r1, r2 = softplus(float(s.theta1[h])), softplus(float(s.theta2[h]))
        return -r1 * math.log(1 + r2 * abs(i - j))
    if name == "kerple_power":
        r1, r2 = softplus(float(s.theta1[h])), 2 * sigmoid(float(s.theta2[h]))
        return -r1 * abs(i - j) ** r2
    if name == "sandwich":
        dbar = s.config.dim or DH
        total = sum(math.cos((i - j) / 10000 ** (2 * k / dbar)) for k in range(1, dbar // 2 + 1))
        return (total - dbar / 2) / (8 * (h + 1) / H)
    if name == "fire":
        c, m, L0 = float(s.c), float(s.multiplier), s.config.threshold

        def psi(x):
            return math.log(abs(c * x) + 1)

        x = psi(i - j) / (psi(max(abs(m * L0), i)) + 1e-6)
        w1, b1 = s.mlp[0].weight[:, 0].tolist(), s.mlp[0].bias.tolist()
        w2, b2 = s.mlp[2].weight.tolist(), s.mlp[2].bias.tolist()
        return b2[h] + sum(w2[h][u] * max(0.0, w1[u] * x + b1[u]) for u in range(len(w1)))
    raise KeyError(name)


# ---- the attention reference (the papers' biases as float64 tensors: helpers.paper_bias) ------------------


def reference(name, s, q, k, v, pos):
    """softmax(q·kᵀ/√Dh + bias, later keys masked by index) · v in float64: (B, H, T, Dh)."""
    q, k, v = q.double(), k.double(), v.double()
    T = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + paper_bias(name, s, pos, heads=H, head_dim=DH)
    future = torch.arange(T)[None, :] > torch.arange(T)[:, None]
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def run(scheme, q, k, v, pos, kernel=None):
    ctx = dispatch.context(scheme, pos, H, q.dtype, kernel=kernel)
    return dispatch.attend(q, k, v, ctx), ctx.kernel


def qkv(T: int, seed: int = 0, scale: float = 1.5, B: int = 2):
    g = torch.Generator().manual_seed(seed)
    return tuple(scale * torch.randn(B, H, T, DH, generator=g) for _ in range(3))


# ---- the bias is the paper's formula ---------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 9])
@pytest.mark.parametrize("name", NAMES)
def test_bias_is_the_paper_formula(name, offset):
    """Dense broadcast calls (the dense kernel's mask) and 0-d calls (as FlexAttention makes them) give the loops'
    values at every causal pair of a window of 2L positions (FIRE's i crosses its threshold L)."""
    s = make_scheme(name)
    T = 2 * L
    pos = torch.arange(T) + offset
    want = loop_bias(name, s, pos)
    with torch.no_grad():
        got = blockwise.dense_mask(s, pos, H, 0, T, torch.float32).double()  # (H, T, T), −inf above
        causal = ~torch.isnan(want)
        assert torch.isinf(got[~causal]).all()
        assert_close(got[causal], want[causal], atol=1e-5, rtol=1e-5)
        zero = torch.zeros(())
        for a, b in [(0, 0), (5, 2), (T - 1, 0), (T - 1, T - 1), (L + 3, 1)]:
            for h in range(H):
                value = s.score_mod(zero, torch.tensor(h, dtype=torch.int32), pos[a], pos[b])
                assert value.dim() == 0
                assert_close(value.double().item(), want[h, a, b].item(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("B, M", [(32, 128), (8, 20), (2, 3), (10, 11)])
def test_t5_buckets_follow_the_paper(B, M):
    s = make_scheme("t5", num_buckets=B, max_distance=M)
    assert s.weight.shape == (B, H) and s.buckets.tolist() == [t5_bucket_by_hand(n, B, M) for n in range(M + 1)]
    pos = torch.arange(3 * M)
    with torch.no_grad():
        bias = blockwise.dense_mask(s, pos, H, 0, 3 * M, torch.float32)  # (H, T, T)
    for n in [0, 1, B // 2, M - 1, M, M + 1, 3 * M - 1]:  # distance n: query n against key 0
        assert torch.equal(bias[:, n, 0], s.weight[t5_bucket_by_hand(n, B, M)])


def test_t5_default_buckets_known_values():
    """B = 32, M = 128: 16 exact buckets, then log-spaced (the T5 code's values)."""
    want = {0: 0, 1: 1, 15: 15, 16: 16, 20: 17, 32: 21, 64: 26, 100: 30, 127: 31, 128: 31, 10_000: 31}
    assert {n: t5_bucket_by_hand(n, 32, 128) for n in want} == want
    s = make_scheme("t5")
    assert {n: int(s.buckets[min(n, 128)]) for n in want} == want


# ---- attention output = the float64 reference, through the chosen kernel and the dense one ----------------


@pytest.mark.parametrize("kernel", [None, "dense"], ids=["auto", "dense"])
@pytest.mark.parametrize("T", [L, 4 * L], ids=["L", "4L"])
@pytest.mark.parametrize("name", NAMES)
def test_attention_matches_float64_reference(name, T, kernel):
    """Evaluation (no gradients): ``auto`` is what the model picks on CPU, FlexAttention compiled (dense where it
    does not compile)."""
    s = make_scheme(name)
    q, k, v = qkv(T, seed=T)
    pos = torch.arange(T)
    with torch.no_grad():
        y, used = run(s, q, k, v, pos, kernel)
        within = name == "fire" and T - 1 <= L  # FIRE's every query within its threshold: a bias of i − j alone
        assert used == (kernel or ("banded" if within else choice.choose_kernel(s, torch.device("cpu"), torch.float32,
                                                                                   0.0, False)))
        assert_close(y.double(), reference(name, s, q, k, v, pos), **TOL)


@pytest.mark.parametrize("name", NAMES)
def test_the_model_s_kernel_choice(name):
    s = make_scheme(name)
    assert type(s).has_bias and not type(s).key_only_bias
    cpu = torch.device("cpu")
    assert choice.choose_kernel(s, cpu, torch.float32, 0.0, True) == "dense"  # CPU training
    evaluation = choice.choose_kernel(s, cpu, torch.float32, 0.0, False)
    if name in INVARIANT:  # a per-distance table: the banded kernel (fused CPU attention with a sliding mask)
        assert evaluation == "banded"
    else:  # FIRE past its threshold: blocks of its folded pair_bias
        assert evaluation == "dense"


@pytest.mark.parametrize("multiplier, kernel", [(1.0, "banded"), (0.5, "dense")])
def test_fire_within_its_learned_threshold_is_evaluated_from_a_table_per_distance(multiplier, kernel, monkeypatch):
    """CPU evaluation of a FIRE window whose positions all lie at or below L_thr = |m·L₀| (every query normalised by
    ψ(L_thr)): the banded kernel, blocks of 5 queries, positions 0…T−1 + 9, equal to the float64 reference. With the
    learned multiplier at 0.5 the same window crosses L_thr and keeps the bias of every pair; with gradients (training)
    it keeps it too."""
    monkeypatch.setattr(blockwise, "FOLD_QUERIES", 5)
    s = make_scheme("fire", threshold=4 * L)
    with torch.no_grad():
        s.multiplier.fill_(multiplier)
    T = 3 * L
    q, k, v = qkv(T, seed=13)
    pos = torch.arange(T) + 9  # the last position, 3L + 8, is within 4L and past 2L
    with torch.no_grad():
        ctx = dispatch.context(s, pos, H, q.dtype)
        y = dispatch.attend(q, k, v, ctx)
    assert ctx.kernel == kernel
    assert_close(y.double(), reference("fire", s, q, k, v, pos), **TOL)
    assert dispatch.context(s, pos, H, q.dtype).kernel == "dense"  # gradients on: the bias of every pair


@pytest.mark.parametrize("positions", ["offset", "random"])
@pytest.mark.parametrize("name", INVARIANT)
def test_the_banded_kernel_over_many_blocks_and_far_keys(name, positions, monkeypatch):
    """CPU evaluation of the per-distance biases: blocks of 5 queries, T = 4L, positions 0…T−1 + 9 (one mask pattern
    for every block) or random increasing ones (a mask per block); T5 with max_distance 6, so most keys of most
    blocks are far (constant bias, unmasked, merged by log-sum-exp). Equal to the float64 reference."""
    monkeypatch.setattr(blockwise, "FOLD_QUERIES", 5)
    s = make_scheme(name, **({"num_buckets": 4, "max_distance": 6} if name == "t5" else {}))
    T = 4 * L
    q, k, v = qkv(T, seed=11)
    g = torch.Generator().manual_seed(5)
    pos = torch.arange(T) + 9 if positions == "offset" else torch.randperm(3 * T, generator=g)[:T].sort().values
    with torch.no_grad():
        ctx = dispatch.context(s, pos, H, q.dtype)
        y = dispatch.attend(q, k, v, ctx)
    assert ctx.kernel == "banded" and len(ctx.blocks) == -(-T // 5)
    assert ctx.far == (6 if name == "t5" else T)
    if positions == "offset":  # one (H, Q, Q + D − 1) pattern, a view of H · (2Q + D − 2) numbers: no T × T anywhere
        assert ctx.masks[0].shape == (H, 5, 5 + ctx.far - 1)
        assert ctx.masks[0].untyped_storage().nbytes() == H * (2 * 5 + ctx.far - 2) * 4
    else:
        assert ctx.masks is None
    assert_close(y.double(), reference(name, s, q, k, v, pos), **TOL)


def test_the_banded_kernel_refuses_positions_that_do_not_increase():
    pos = torch.arange(L).flip(0)
    with pytest.raises(ValueError, match="increasing positions"):
        dispatch.context(make_scheme("t5"), pos, H, kernel="banded")


@pytest.mark.parametrize("kernel", [None, "dense"], ids=["auto", "dense"])
@pytest.mark.parametrize("name", NAMES)
def test_a_later_token_does_not_change_earlier_outputs(name, kernel):
    T = 4 * L
    s = make_scheme(name)
    q, k, v = qkv(T, seed=1)
    pos = torch.arange(T)
    with torch.no_grad():
        base, _ = run(s, q, k, v, pos, kernel)
        for t in (0, L - 1, L, T - 2):
            q2, k2, v2 = q.clone(), k.clone(), v.clone()
            q2[:, :, t + 1:] += 1.0
            k2[:, :, t + 1:] += 1.0
            v2[:, :, t + 1:] -= 2.0
            out, _ = run(s, q2, k2, v2, pos, kernel)
            assert torch.equal(out[:, :, : t + 1], base[:, :, : t + 1]), f"index <= {t} saw a later token"
            assert not torch.allclose(out[:, :, t + 1], base[:, :, t + 1])


# ---- translation invariance (not FIRE) ------------------------------------------------------------------


@pytest.mark.parametrize("name", INVARIANT)
def test_shifting_every_position_leaves_the_output_unchanged(name):
    T = 4 * L
    s = make_scheme(name)
    q, k, v = qkv(T, seed=2)
    with torch.no_grad():
        base, _ = run(s, q, k, v, torch.arange(T), "dense")
        for shift in (1, 1000, 123_457):
            shifted, _ = run(s, q, k, v, torch.arange(T) + shift, "dense")
            assert_close(shifted, base, atol=1e-6, rtol=1e-6)


def test_fire_depends_on_the_query_position():
    """Below the threshold the normaliser is ψ(L_thr) for every query, so FIRE's bias depends on i − j alone;
    past it, on i too: shifting every position changes the output."""
    T = 4 * L
    s = make_scheme("fire")
    with torch.no_grad():
        bias = blockwise.dense_mask(s, torch.arange(T), H, 0, T, torch.float64)  # (H, T, T)
        assert_close(bias[:, 5, 2], bias[:, 9, 6])  # i = 5, 9 < L: same distance, same bias
        assert not torch.allclose(bias[:, L + 20, L + 17], bias[:, 5, 2])  # i past L: normalised by ψ(i)
        q, k, v = qkv(T, seed=2)
        base, _ = run(s, q, k, v, torch.arange(T), "dense")
        shifted, _ = run(s, q, k, v, torch.arange(T) + 1000, "dense")
    assert not torch.allclose(shifted, base, atol=1e-3)


# ---- gradients of the learned parameters ----------------------------------------------------------------


def learned(s) -> dict[str, torch.Tensor]:
    return dict(s.named_parameters())


@pytest.mark.parametrize("name", LEARNED)
def test_learned_parameters_get_the_reference_gradients(name):
    """Through the kernel the model trains with on CPU (dense): d(loss)/d(q, k, v, every parameter) equal the
    float64 reference's."""
    T = 2 * L + 3
    s = make_scheme(name)
    q, k, v = (t.requires_grad_() for t in qkv(T, seed=4))
    pos = torch.arange(T)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    y, used = run(s, q, k, v, pos)
    assert used == "dense"
    (y.double() * weight).sum().backward()
    tensors = {"q": q, "k": k, "v": v, **learned(s)}
    got = {n: t.grad.clone() for n, t in tensors.items()}
    for t in tensors.values():
        t.grad = None
    (reference(name, s, q, k, v, pos) * weight).sum().backward()
    for n, t in tensors.items():
        assert torch.isfinite(got[n]).all() and got[n].abs().sum() > 0, n
        assert_close(got[n].double(), t.grad.double(), atol=1e-4, rtol=1e-4, msg=lambda m: f"d/d{n}: {m}")


def spec_of(name: str, seq_len: int = L) -> dict:
    cfg = {"scheme": {"name": name}, "train": {"seq_len": seq_len},
           "model": {"n_layer": 2, "n_head": H, "d_model": H * DH, "d_ff": 64}}
    return build.model_spec(cfg, VOCAB)


@pytest.mark.parametrize("name", LEARNED)
def test_a_model_s_loss_reaches_every_learned_parameter(name):
    torch.manual_seed(0)
    model = build.build_model(spec_of(name))
    idx = torch.randint(0, VOCAB, (2, 2 * L + 1), generator=torch.Generator().manual_seed(1))
    model(idx[:, :-1], targets=idx[:, 1:]).mean().backward()
    params = dict(model.scheme.named_parameters())
    assert params and model.layer_schemes[0].weight_decay is False
    for n, p in params.items():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n


@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_round_trip_gives_the_same_outputs(name):
    spec = spec_of(name)
    torch.manual_seed(0)
    model = build.build_model(spec).eval()
    state = model.state_dict()
    torch.manual_seed(1)  # a different draw of every weight, the scheme's included
    fresh = build.build_model(spec).eval()
    if name in LEARNED:
        assert any(not torch.equal(a, b) for a, b in zip(fresh.scheme.parameters(), model.scheme.parameters()))
    fresh.load_state_dict(state)
    idx = torch.randint(0, VOCAB, (2, 3 * L), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(fresh(idx), model(idx))
    assert spec["scheme"]["name"] == name
    if name == "fire":
        assert spec["scheme"]["threshold"] == 512 and spec["scheme"]["per_layer"]  # the reference's, recorded in the spec


# ---- KERPLE stays in range -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power"])
def test_kerple_parameters_stay_positive_whatever_the_optimiser_does(name):
    s = make_scheme(name)
    r1, r2 = s.r1(), s.r2()
    hi = 1.0 if name == "kerple_power" else 2.0  # the reference's init ranges: r₁ < hi, r₂ < 3 − hi
    assert (r1 >= 0.01 - 1e-6).all() and (r1 < hi).all() and (r2 >= 0.01 - 1e-6).all() and (r2 < 3 - hi).all()
    with torch.no_grad():
        s.theta1.copy_(torch.tensor([-60.0, -5.0, 5.0, 60.0]))
        s.theta2.copy_(torch.tensor([-60.0, -5.0, 5.0, 60.0]))
        assert (s.r1() > 0).all() and (s.r2() > 0).all()
        if name == "kerple_power":
            assert (s.r2() <= 2).all()
        bias = blockwise.dense_mask(s, torch.arange(4 * L), H, 0, 4 * L, torch.float32)
        assert not torch.isnan(bias).any() and (bias[torch.isfinite(bias)] <= 0).all()


# ---- Config checks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, options, message", [
    ("t5", {"num_buckets": 1}, "num_buckets=1: "),
    ("t5", {"num_buckets": 32.5}, "num_buckets=32.5: "),
    ("t5", {"max_distance": 16}, "max_distance=16: must be an integer > num_buckets // 2 = 16"),
    ("t5", {"num_buckets": 8, "max_distance": 3}, "max_distance=3: "),
    ("kerple_log", {"r1_max": 0.0}, "r1_max=0.0: "),
    ("kerple_log", {"r2_max": -1.0}, "r2_max=-1.0: "),
    ("kerple_power", {"r2_max": 3.0}, "r2_max=3.0: the power kernel needs r2 <= 2"),
    ("kerple_power", {"r1_max": float("nan")}, "r1_max=nan: "),
    ("sandwich", {"dim": 7}, "dim=7: "),
    ("sandwich", {"dim": 0}, "dim=0: "),
    ("fire", {"mlp_width": 0}, "mlp_width=0: "),
    ("fire", {"init_c": 0.0}, "init_c=0.0: "),
    ("fire", {"init_c": -0.1}, "init_c=-0.1: "),
    ("fire", {"threshold": 0}, "threshold=0: "),
])
def test_config_refuses_bad_values(name, options, message):
    cfg = SCHEMES[name].make_config(**options)
    with pytest.raises(ValueError) as info:
        cfg.resolve(L, 4 * L)
    assert str(info.value).startswith(message), str(info.value)
    with pytest.raises(ValueError):  # and the constructor refuses them too
        build_scheme(name, H * DH, H, **({"threshold": L} if name == "fire" and "threshold" not in options else {}),
                     **options)


def test_config_defaults_and_resolution():
    fire = SCHEMES["fire"].Config()
    fire.resolve(128, 2048)
    assert (fire.mlp_width, fire.init_c, fire.threshold, fire.per_layer) == (32, 0.1, 512, True)  # the reference's
    earlier = SCHEMES["fire"].Config(threshold=None)
    earlier.resolve(128, 2048)
    assert earlier.threshold == 128  # null: the threshold starts at L
    t5 = SCHEMES["t5"].Config()
    t5.resolve(128, 2048)
    assert (t5.num_buckets, t5.max_distance) == (32, 128)
    assert build_scheme("fire", H * DH, H, threshold=None).config.threshold == 512  # never resolved: init_L
    with pytest.raises(ValueError, match="scheme.dim"):
        build_scheme("sandwich", 12, 4)  # head width 3, odd: Sandwich needs an even code width
    assert make_scheme("sandwich", dim=None).half == DH // 2  # null: the head width


# ---- the command line ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def registered():
    cli.register()  # the scheme group, made from SCHEMES (which holds this module's schemes)


@pytest.mark.parametrize("name", NAMES)
def test_posbench_train_debug_fast_composes_and_finalizes(name, registered):
    with initialize_config_module(cli.CONFIG_MODULE, version_base="1.3"):
        cfg = to_dict(finalize(compose("train", overrides=[f"scheme={name}", "debug=fast"])))
        assert cfg["scheme"]["name"] == name
        expected = {"t5": {"num_buckets": 32, "max_distance": 128}, "kerple_log": {"r1_max": None, "r2_max": None},
                    "kerple_power": {"r1_max": None, "r2_max": None}, "sandwich": {"dim": None},
                    "fire": {"mlp_width": 32, "init_c": 0.1, "threshold": 512, "per_layer": True}}[name]
        assert cfg["scheme"] == {"name": name, **expected}
        spec = build.model_spec(cfg, VOCAB)
        build.build_model(spec, {"model": {"n_layer": 1}})  # the composed config builds a model
        bad = {"t5": "scheme.num_buckets=1", "kerple_log": "scheme.r1_max=-1", "kerple_power": "scheme.r2_max=5",
               "sandwich": "scheme.dim=3", "fire": "scheme.threshold=0"}[name]
        with pytest.raises(ConfigError, match=rf"^{bad.split('=')[0]}="):
            finalize(compose("train", overrides=[f"scheme={name}", "debug=fast", bad]))
