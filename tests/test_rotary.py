"""RoPE's context-extension methods (``scheme.scaling``) against their papers' formulas, computed here with
python math for every position and dimension pair (never through the scheme's own helpers):

* none — bit-identical to RoPE before scaling existed (old checkpoints read with the defaults)
* linear — Position Interpolation, Chen et al. 2023: the angle of position p is (p/s)·θ_i
* ntk — NTK-aware scaling: θ_i from base' = base · s^(Dh/(Dh−2))
* dynamic_ntk — the NTK base of s_T = max(1, s·T/L − (s − 1)) for a window of T positions (HF transformers'
  ``_compute_dynamic_ntk_parameters``)
* yarn — Peng et al. 2023: h(θ_d) = (1 − γ(r))·θ_d/s + γ(r)·θ_d with r = L/λ_d, λ_d = 2π/θ_d, the ramp γ
  between α = beta_slow and β = beta_fast, and cos and sin multiplied by √(1/t) = 0.1·ln(s) + 1

and xPos (Sun et al. 2022): RoPE with pair i of a query scaled by ζ_i^((p − c)/B) and of a key by ζ_i^(−(p − c)/B),
ζ_i = (i/(Dh/2) + γ)/(1 + γ), c the window's middle: the formula in float64, translation invariance, causality, and
finite scales at 16384 positions.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.testing import assert_close

from helpers import rope_tables, yarn_frequencies
from posbench.model.build import build_model
from posbench.schemes import build_scheme
from posbench.schemes.rotary import RoPE

DH = 16  # head width of every scheme below (d_model 32, 2 heads)


def scheme(**options) -> RoPE:
    return build_scheme("rope", 2 * DH, 2, **options)


def theta(i, base=10000.0, dh=DH):
    return base ** (-2 * i / dh)


def check_tables(rope, positions, angle, mscale=1.0):
    cos, sin = rope.rotation(torch.tensor(positions), torch.float64)
    want_cos, want_sin = rope_tables(positions, angle, mscale)
    assert_close(cos, want_cos, rtol=0, atol=1e-9)
    assert_close(sin, want_sin, rtol=0, atol=1e-9)


POSITIONS = [0, 1, 2, 3, 31, 32, 100, 511, 512, 2047, 4095]


# ---- none: today's RoPE, bit for bit --------------------------------------------------------------


def old_rope_tables(pos, dtype, head_dim=DH, base=10000.0):
    """RoPE's tables as posbench computed them before ``scaling`` existed (posbench/rotary.py at a7aec75)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = pos.to(torch.float64)[:, None] * inv_freq
    sin = angles.sin()
    return torch.cat((angles, angles), dim=-1).cos().to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, {"scaling": "none", "factor": 1.0}, {"base": 500.0}])
def test_none_is_bit_identical_to_rope_before_scaling(dtype, options):
    pos = torch.tensor([*range(70), 1000, 4095, 16383, 65535])
    new = scheme(**options).rotation(pos, dtype)
    old = old_rope_tables(pos, dtype, base=options.get("base", 10000.0))
    assert all(torch.equal(a, b) for a, b in zip(new, old))


def test_a_spec_without_scaling_keys_builds_the_same_model():
    """An old checkpoint's spec lacks the new keys: it reads as scaling=none and gives the same logits."""
    spec = {"vocab_size": 40, "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64},
            "scheme": {"name": "rope", "base": 10000.0}}
    torch.manual_seed(0)
    old = build_model(spec).eval()
    torch.manual_seed(0)
    new = build_model(spec, {"scheme": {"scaling": "none", "factor": 1.0}}).eval()
    assert old.scheme.config.scaling == "none"
    x = torch.randint(0, 40, (2, 50))
    with torch.no_grad():
        assert torch.equal(old(x), new(x))


# ---- each method against its formula --------------------------------------------------------------


@pytest.mark.parametrize("s", [1.0, 2.0, 4.0, 16.0])
def test_linear_divides_positions_by_the_factor(s):
    rope = scheme(scaling="linear", factor=s, original_length=64)
    check_tables(rope, POSITIONS, lambda p, i: (p / s) * theta(i))


@pytest.mark.parametrize("s", [1.0, 2.0, 8.0])
@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_ntk_scales_the_base(s, base):
    rope = scheme(scaling="ntk", factor=s, base=base, original_length=64)
    new_base = base * s ** (DH / (DH - 2))
    check_tables(rope, POSITIONS, lambda p, i: p * new_base ** (-2 * i / DH))
    if s > 1:  # the lowest frequency is interpolated by exactly s
        assert (base * s ** (DH / (DH - 2))) ** (-(DH - 2) / DH) == pytest.approx(theta(DH // 2 - 1, base) / s)


@pytest.mark.parametrize("T", [1, 20, 64, 65, 128, 256, 1024])
@pytest.mark.parametrize("s", [2.0, 4.0])
def test_dynamic_ntk_uses_the_windows_length(T, s):
    L = 64
    rope = scheme(scaling="dynamic_ntk", factor=s, original_length=L)
    s_T = max(1.0, s * T / L - (s - 1))  # HF transformers: base * ((factor * seq_len / L) - (factor - 1)) ** (d/(d-2))
    new_base = 10000.0 * s_T ** (DH / (DH - 2))
    positions = list(range(T))
    check_tables(rope, positions, lambda p, i: p * new_base ** (-2 * i / DH))
    if T <= L:  # within the train length: plain RoPE
        check_tables(rope, positions, lambda p, i: p * theta(i))


def yarn_frequency(i, s, L, alpha, beta, base=10000.0):
    t = theta(i, base)
    r = L / (2 * math.pi / t)  # rotations of pair i over the train length, r = L / λ_i
    gamma = 0.0 if r < alpha else 1.0 if r > beta else (r - alpha) / (beta - alpha)
    return (1 - gamma) * t / s + gamma * t


@pytest.mark.parametrize("s", [2.0, 16.0])
@pytest.mark.parametrize("alpha, beta", [(1.0, 32.0), (2.0, 8.0)])
def test_yarn_interpolates_by_parts_with_temperature(s, alpha, beta):
    L = 512  # Dh = 16, base 10^4: pairs 0 (r ≈ 81), 1…3 (r ≈ 26, 8, 2.6) and 4… (r < 1) fall in every region
    rope = scheme(scaling="yarn", factor=s, original_length=L, beta_fast=beta, beta_slow=alpha, yarn_ramp="paper")
    regions = {(yarn_frequency(i, s, L, alpha, beta) == theta(i), yarn_frequency(i, s, L, alpha, beta) == theta(i) / s)
               for i in range(DH // 2)}
    assert regions == {(True, False), (False, True), (False, False)}  # kept, interpolated, and in the ramp
    mscale = 0.1 * math.log(s) + 1
    check_tables(rope, POSITIONS, lambda p, i: p * yarn_frequency(i, s, L, alpha, beta), mscale)
    # the temperature: every score is (0.1 ln s + 1)² times the score of the rotation without it
    q, k = torch.randn(1, 1, 5, DH, dtype=torch.float64), torch.randn(1, 1, 5, DH, dtype=torch.float64)
    qr, kr = rope.rotate(q, k, rope.rotation(torch.arange(5), torch.float64))
    assert_close(qr.norm(dim=-1), mscale * q.norm(dim=-1))
    assert_close(kr.norm(dim=-1), mscale * k.norm(dim=-1))


@pytest.mark.parametrize("options", [{"scaling": "linear", "factor": 4.0}, {"scaling": "ntk", "factor": 4.0},
                                     {"scaling": "yarn", "factor": 4.0}])
def test_scaled_scores_depend_only_on_relative_position(options):
    torch.manual_seed(3)
    rope = scheme(original_length=128, **options)
    q, k = torch.randn(1, 2, 1, DH, dtype=torch.float64), torch.randn(1, 2, 1, DH, dtype=torch.float64)

    def score(m, n):
        qm, _ = rope.rotate(q, q, rope.rotation(torch.tensor([m]), torch.float64))
        _, kn = rope.rotate(k, k, rope.rotation(torch.tensor([n]), torch.float64))
        return (qm * kn).sum(-1)

    for m, n, shift in [(5, 2, 100), (300, 17, 4000), (0, 0, 777)]:
        assert_close(score(m + shift, n + shift), score(m, n))


def test_dynamic_ntk_scores_within_a_window_depend_only_on_relative_position():
    torch.manual_seed(4)
    rope = scheme(scaling="dynamic_ntk", factor=4.0, original_length=32)
    T = 200
    q, k = torch.randn(1, 1, T, DH, dtype=torch.float64), torch.randn(1, 1, T, DH, dtype=torch.float64)
    q[:, :, 1:] = q[:, :, :1]  # the same vector at every position
    k[:, :, 1:] = k[:, :, :1]
    qr, kr = rope.rotate(q, k, rope.rotation(torch.arange(T), torch.float64))
    scores = qr[0, 0] @ kr[0, 0].T  # (T, T)
    assert_close(scores[150, 140], scores[20, 10])
    assert_close(torch.diagonal(scores, -10), torch.full((T - 10,), scores[10, 0].item(), dtype=torch.float64))


# ---- the configuration -----------------------------------------------------------------------------


def resolved(seq_len=64, **options):
    config = RoPE.make_config(**options)
    config.resolve(seq_len, seq_len)
    return config


def test_original_length_resolves_to_the_train_length_when_a_method_is_chosen():
    assert resolved().original_length is None  # scaling=none: old configs resolve as they did
    assert resolved(scaling="yarn", factor=4.0).original_length == 64
    assert resolved(scaling="linear", factor=4.0, original_length=128).original_length == 128
    fields = {f.name: f.default for f in dataclasses.fields(RoPE.Config)}
    assert fields == {"base": 10000.0, "scaling": "none", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_length": None, "yarn_ramp": "reference", "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "rotary_fraction": 1.0}


@pytest.mark.parametrize("options, start", [
    ({"scaling": "xpos"}, "scaling='xpos'"),
    ({"scaling": "linear", "factor": 0.5}, "factor=0.5"),
    ({"scaling": "ntk", "factor": float("nan")}, "factor=nan"),
    ({"factor": 4.0}, "factor=4.0"),
    ({"scaling": "yarn", "factor": 4.0, "beta_slow": 32.0, "beta_fast": 1.0}, "beta_slow=32.0"),
    ({"scaling": "yarn", "factor": 4.0, "beta_slow": 0.0}, "beta_slow=0.0"),
    ({"scaling": "linear", "factor": 2.0, "original_length": 0}, "original_length=0"),
    ({"base": -1.0}, "base=-1.0"),
])
def test_bad_values_are_refused_naming_the_option(options, start):
    with pytest.raises(ValueError) as err:
        resolved(**options)
    assert str(err.value).startswith(start), str(err.value)


def test_a_method_without_a_train_length_is_refused_at_construction():
    with pytest.raises(ValueError, match="original_length"):
        scheme(scaling="yarn", factor=4.0)


# ---- xPos (Sun et al. 2022) ------------------------------------------------------------------------


def naive_xpos(x, p, centre, query, dh=DH, base=10000.0, gamma=0.4, scale_base=512.0):
    """Vector x (python list) at position p: pair (i, i + Dh/2) turned by p·base^(−2i/Dh), then scaled by
    ζ_i^(±(p − centre)/scale_base), ζ_i = (i/(Dh/2) + γ)/(1 + γ), + for a query and − for a key."""
    half = dh // 2
    out = list(x)
    for i in range(half):
        a = p * base ** (-2 * i / dh)
        zeta = (i / half + gamma) / (1 + gamma)
        scale = zeta ** ((p - centre) / scale_base * (1 if query else -1))
        out[i] = scale * (x[i] * math.cos(a) - x[i + half] * math.sin(a))
        out[i + half] = scale * (x[i] * math.sin(a) + x[i + half] * math.cos(a))
    return out


@pytest.mark.parametrize("options", [{}, {"gamma": 0.8, "scale_base": 64.0, "base": 500.0}])
@pytest.mark.parametrize("start", [0, 1000])
def test_xpos_matches_the_paper_in_float64(options, start):
    torch.manual_seed(5)
    xpos = build_scheme("xpos", 2 * DH, 2, **options)
    pos = torch.arange(start, start + 40)
    q, k = torch.randn(1, 2, 40, DH, dtype=torch.float64), torch.randn(1, 2, 40, DH, dtype=torch.float64)
    qr, kr = xpos.rotate(q, k, xpos.rotation(pos, torch.float64))
    centre = start + 39 / 2
    for h in range(2):
        for t in (0, 1, 17, 39):
            p = start + t
            assert_close(qr[0, h, t], torch.tensor(naive_xpos(q[0, h, t].tolist(), p, centre, True, **options),
                                                   dtype=torch.float64))
            assert_close(kr[0, h, t], torch.tensor(naive_xpos(k[0, h, t].tolist(), p, centre, False, **options),
                                                   dtype=torch.float64))
    # the score of query n and key m: RoPE's, with ζ_i^((n − m)/B) on pair i (the paper's decay)
    n, m = 30, 10
    half = DH // 2
    want = 0.0
    for i in range(half):
        zeta = (i / half + options.get("gamma", 0.4)) / (1 + options.get("gamma", 0.4))
        a = (n - m) * options.get("base", 10000.0) ** (-2 * i / DH)
        qi, qj = q[0, 0, n, i].item(), q[0, 0, n, i + half].item()
        ki, kj = k[0, 0, m, i].item(), k[0, 0, m, i + half].item()
        want += zeta ** ((n - m) / options.get("scale_base", 512.0)) * (
            (qi * ki + qj * kj) * math.cos(a) + (qi * kj - qj * ki) * math.sin(a))
    assert (qr[0, 0, n] * kr[0, 0, m]).sum().item() == pytest.approx(want, rel=1e-9)


def test_xpos_scores_are_translation_invariant():
    torch.manual_seed(6)
    xpos = build_scheme("xpos", 2 * DH, 2)
    T = 64
    q, k = torch.randn(1, 2, T, DH, dtype=torch.float64), torch.randn(1, 2, T, DH, dtype=torch.float64)

    def scores(pos):
        qr, kr = xpos.rotate(q, k, xpos.rotation(pos, torch.float64))
        return qr @ kr.transpose(-1, -2)  # (1, 2, T, T)

    base = scores(torch.arange(T))
    for shift in (1, 37, 5000):
        assert_close(scores(torch.arange(T) + shift), base)
    # the same vectors at every position: a score depends on n − m only
    qr, kr = xpos.rotate(q[:, :, :1].expand(-1, -1, T, -1), k[:, :, :1].expand(-1, -1, T, -1),
                         xpos.rotation(torch.arange(T), torch.float64))
    s = (qr @ kr.transpose(-1, -2))[0, 0]
    assert_close(torch.diagonal(s, -5), torch.full((T - 5,), s[5, 0].item(), dtype=torch.float64))
    assert not torch.allclose(s[5, 0], s[6, 0])


def tiny_xpos_model(seed=0):
    torch.manual_seed(seed)
    spec = {"vocab_size": 40, "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64},
            "scheme": {"name": "xpos"}}
    return build_model(spec).eval()


def test_xpos_model_is_causal_and_its_windows_need_no_fixed_centre():
    model = tiny_xpos_model().double()
    idx = torch.randint(0, 40, (2, 48), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = model(idx)
        for t in (1, 10, 47):
            changed = idx.clone()
            changed[:, t] = (idx[:, t] + 1) % 40
            out = model(changed)
            assert_close(out[:, :t], full[:, :t])  # a later token changes no earlier logit
            assert not torch.allclose(out[:, t], full[:, t])
            # a shorter window (another centre) gives the same logits for the positions it has
            assert_close(model(idx[:, :t]), full[:, :t])


def test_xpos_is_finite_at_16384_positions():
    xpos = build_scheme("xpos", 2 * DH, 2)
    pos = torch.arange(16384)
    tables = xpos.rotation(pos, torch.float32)
    assert all(torch.isfinite(t).all() for t in tables)
    assert max(t.abs().max().item() for t in tables) < 1e10  # centred: ζ_0^(-16) ≈ 5e8, not ζ_0^(-32) ≈ 2.5e17
    model = tiny_xpos_model()
    idx = torch.randint(0, 40, (1, 16384), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        logits = model(idx)
    assert torch.isfinite(logits).all()


def test_xpos_options_are_checked():
    for options, start in [({"gamma": 0.0}, "gamma=0.0"), ({"scale_base": -1.0}, "scale_base=-1.0"),
                           ({"base": 0.0}, "base=0.0")]:
        config = build_scheme("xpos", 2 * DH, 2).make_config(**options)
        with pytest.raises(ValueError) as err:
            config.resolve(64, 64)
        assert str(err.value).startswith(start)


# ---- YaRN's ramp as the reference code and HF compute it (the default) ----------------------------


@pytest.mark.parametrize("s, L", [(4.0, 128), (16.0, 128), (2.0, 512), (8.0, 64)])
@pytest.mark.parametrize("dh", [16, 32, 64])
def test_yarn_default_is_the_reference_codes_ramp(s, L, dh):
    rope = build_scheme("rope", 2 * dh, 2, scaling="yarn", factor=s, original_length=L)
    want = yarn_frequencies(dh, s, L)
    mscale = 0.1 * math.log(s) + 1
    cos, sin = rope.rotation(torch.tensor(POSITIONS), torch.float64)
    want_cos, want_sin = rope_tables(POSITIONS, lambda p, i: p * want[i], mscale, dh=dh)
    assert_close(cos, want_cos, rtol=0, atol=1e-9)
    assert_close(sin, want_sin, rtol=0, atol=1e-9)


def test_the_reference_ramp_on_llama_2_runs_from_pair_20_to_46():
    """Head width 128, base 10^4, L = 4096, β 32 and 1: the reference code's correction range is pairs 20 to 46
    (the pairs turning 32 and 1 times over 4096 positions are 20.9 and 45.0), so pairs up to 20 keep θ, from 46 on
    they are θ/s, and the ramp between is linear in the pair index."""
    s = 8.0
    freqs = yarn_frequencies(128, s, 4096)
    theta = [10000.0 ** (-2 * i / 128) for i in range(64)]
    assert freqs[:21] == pytest.approx(theta[:21], rel=1e-12)
    assert freqs[46:] == pytest.approx([t / s for t in theta[46:]], rel=1e-12)
    assert all(theta[i] / s < freqs[i] < theta[i] for i in range(21, 46))  # inside the ramp: between the two
    rope = build_scheme("rope", 256, 2, scaling="yarn", factor=s, original_length=4096)
    got = rope.rotation(torch.tensor([1]), torch.float64)[0][0, :64] / (0.1 * math.log(s) + 1)  # cos(θ'_i) at p = 1
    assert_close(got, torch.tensor([math.cos(f) for f in freqs], dtype=torch.float64), rtol=0, atol=1e-12)


def test_the_two_ramps_differ_inside_the_ramp_only():
    """model=tiny's head (Dh 32), L = 128, s = 16: both ramps keep the fast pairs and interpolate the slow ones, and
    give other frequencies in between (the reference code's ramp is not the paper's)."""
    L, s, dh = 128, 16.0, 32
    reference = build_scheme("rope", 2 * dh, 2, scaling="yarn", factor=s, original_length=L)
    paper = build_scheme("rope", 2 * dh, 2, scaling="yarn", factor=s, original_length=L, yarn_ramp="paper")
    a = reference.rotation(torch.tensor([1]), torch.float64)[1][0, dh // 2:]  # sin(θ'_i) · mscale at p = 1
    b = paper.rotation(torch.tensor([1]), torch.float64)[1][0, dh // 2:]
    theta = torch.tensor([10000.0 ** (-2 * i / dh) for i in range(dh // 2)], dtype=torch.float64)
    ms = 0.1 * math.log(s) + 1
    kept, interpolated = (a / ms - theta.sin()).abs() < 1e-12, (a / ms - (theta / s).sin()).abs() < 1e-12
    assert kept[0] and interpolated[-1] and not torch.equal(a, b)
    inside = ~kept & ~interpolated
    assert inside.any() and not torch.allclose(a[inside], b[inside], rtol=0.05)


# ---- every rotary scheme takes every scaling ---------------------------------------------------------


@pytest.mark.parametrize("options, angle", [
    ({"scaling": "linear", "factor": 4.0, "original_length": 64}, lambda p, i: p / 4.0 * theta(i)),
    ({"scaling": "ntk", "factor": 4.0, "original_length": 64},
     lambda p, i: p * (10000.0 * 4.0 ** (DH / (DH - 2))) ** (-2 * i / DH)),
    ({"scaling": "yarn", "factor": 4.0, "original_length": 64}, None),
])
def test_xpos_takes_the_scalings_of_rope(options, angle):
    """xPos with a scaling: the scaled angle of RoPE's method on each pair, times xPos's decay, times YaRN's
    √(1/t) on the tables where it applies; computed per position and pair in python math."""
    if angle is None:
        freqs = yarn_frequencies(DH, 4.0, 64)
        angle = lambda p, i: p * freqs[i]  # noqa: E731
    mscale = 0.1 * math.log(4.0) + 1 if options["scaling"] == "yarn" else 1.0
    xpos = build_scheme("xpos", 2 * DH, 2, **options)
    pos = torch.arange(40)
    torch.manual_seed(7)
    q, k = torch.randn(1, 2, 40, DH, dtype=torch.float64), torch.randn(1, 2, 40, DH, dtype=torch.float64)
    qr, kr = xpos.rotate(q, k, xpos.rotation(pos, torch.float64))
    half, centre = DH // 2, 39 / 2
    for t in (0, 5, 39):
        for i in range(half):
            zeta = (i / half + 0.4) / 1.4
            for out, x, sign in ((qr, q, 1), (kr, k, -1)):
                scale = mscale * zeta ** (sign * (t - centre) / 512.0)
                a = angle(t, i)
                x1, x2 = x[0, 0, t, i].item(), x[0, 0, t, i + half].item()
                assert out[0, 0, t, i].item() == pytest.approx(scale * (x1 * math.cos(a) - x2 * math.sin(a)), rel=1e-9, abs=1e-12)
                assert out[0, 0, t, i + half].item() == pytest.approx(scale * (x2 * math.cos(a) + x1 * math.sin(a)),
                                                                      rel=1e-9, abs=1e-12)


def test_xpos_without_a_scaling_is_xpos_before_scalings_existed():
    """An xPos checkpoint of before (its spec has base, gamma, scale_base only) builds the model it trained."""
    xpos = build_scheme("xpos", 2 * DH, 2)
    pos = torch.arange(3, 50)
    p = pos.to(torch.float64)
    exponent = torch.arange(0, DH, 2, dtype=torch.float64) / DH
    angles = p[:, None] * 10000.0 ** (-exponent)  # posbench/rotary.py at d1a89df, written out
    centre = (p.min() + p.max()) / 2
    scale = ((exponent + 0.4) / 1.4) ** ((p - centre)[:, None] / 512.0)
    sin = angles.sin()
    cos, sin, scale = (torch.cat(t, dim=-1) for t in ((angles.cos(), angles.cos()), (-sin, sin), (scale, scale)))
    old = tuple(t.to(torch.float32) for t in (cos * scale, sin * scale, cos / scale, sin / scale))
    assert all(torch.equal(a, b) for a, b in zip(xpos.rotation(pos, torch.float32), old))


# ---- partial rotary (GPT-NeoX's rotary_pct) ---------------------------------------------------------


def naive_partial(x, p, fraction, dh=DH, base=10000.0):
    """Vector x (python list) at position p, as GPT-NeoX rotates it (Black et al. 2022, §2; HF's GPTNeoX with
    ``rotary_pct``): the first d = 2·max(1, ⌊⌊f·Dh⌋/2⌋) dimensions form pairs (i, i + d/2) turned by
    p·base^(−2i/d); the other Dh − d dimensions pass unchanged."""
    d = 2 * max(1, int(fraction * dh) // 2)
    out = list(x)
    for i in range(d // 2):
        a = p * base ** (-2 * i / d)
        out[i] = x[i] * math.cos(a) - x[i + d // 2] * math.sin(a)
        out[i + d // 2] = x[i + d // 2] * math.cos(a) + x[i] * math.sin(a)
    return out


@pytest.mark.parametrize("fraction, rotated", [(0.25, 4), (0.5, 8), (0.75, 12), (0.3, 4), (0.1, 2), (0.01, 2)])
def test_partial_rotary_turns_the_first_dimensions_as_gpt_neox(fraction, rotated):
    rope = scheme(rotary_fraction=fraction)
    assert rope.rotated == rotated
    torch.manual_seed(9)
    q, k = torch.randn(1, 2, 6, DH, dtype=torch.float64), torch.randn(1, 2, 6, DH, dtype=torch.float64)
    pos = torch.tensor([0, 1, 7, 100, 511, 4095])
    qr, kr = rope.rotate(q, k, rope.rotation(pos, torch.float64))
    for h in range(2):
        for t, p in enumerate(pos.tolist()):
            assert_close(qr[0, h, t], torch.tensor(naive_partial(q[0, h, t].tolist(), p, fraction), dtype=torch.float64))
            assert_close(kr[0, h, t], torch.tensor(naive_partial(k[0, h, t].tolist(), p, fraction), dtype=torch.float64))
    assert torch.equal(qr[..., rotated:], q[..., rotated:])  # the rest carries no position


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_fraction_1_is_rope_bit_for_bit(dtype):
    pos = torch.tensor([*range(70), 1000, 16383])
    whole = scheme(rotary_fraction=1.0)
    assert all(torch.equal(a, b) for a, b in zip(whole.rotation(pos, dtype), old_rope_tables(pos, dtype)))
    q = torch.randn(1, 2, len(pos), DH).to(dtype)
    cos, sin = old_rope_tables(pos, dtype)
    x1, x2 = q.chunk(2, dim=-1)
    assert torch.equal(whole.rotate(q, q, whole.rotation(pos, dtype))[0], q * cos + torch.cat((x2, x1), dim=-1) * sin)


def test_partial_rotary_scores_depend_on_relative_position_and_take_the_scalings():
    torch.manual_seed(10)
    q, k = torch.randn(1, 1, 1, DH, dtype=torch.float64), torch.randn(1, 1, 1, DH, dtype=torch.float64)
    for options in ({}, {"scaling": "yarn", "factor": 4.0, "original_length": 64}):
        rope = scheme(rotary_fraction=0.5, **options)

        def score(m, n):
            qm, _ = rope.rotate(q, q, rope.rotation(torch.tensor([m]), torch.float64))
            _, kn = rope.rotate(k, k, rope.rotation(torch.tensor([n]), torch.float64))
            return (qm * kn).sum()

        assert_close(score(305, 300), score(5, 0))
    # with a scaling, the rotated part uses the method's frequencies of a d-wide RoPE (d = 8 of Dh = 16)
    rope = scheme(rotary_fraction=0.5, scaling="yarn", factor=4.0, original_length=64)
    freqs = yarn_frequencies(8, 4.0, 64)
    cos, _ = rope.rotation(torch.tensor([3]), torch.float64)
    assert_close(cos[0, :4], torch.tensor([(0.1 * math.log(4.0) + 1) * math.cos(3 * f) for f in freqs], dtype=torch.float64))


@pytest.mark.parametrize("value", [0.0, 1.5, -0.25, float("nan")])
def test_a_rotary_fraction_outside_0_1_is_refused(value):
    with pytest.raises(ValueError) as err:
        resolved(rotary_fraction=value)
    assert str(err.value).startswith(f"rotary_fraction={value!r}"), str(err.value)


def test_labels_name_the_rotated_fraction_and_the_ramp():
    from posbench.schemes import variant_label

    assert variant_label({"name": "rope", "rotary_fraction": 0.25}) == "rope+partial0.25"
    assert variant_label({"name": "rope", "rotary_fraction": 0.25, "scaling": "yarn", "factor": 4.0}) == "rope+partial0.25+yarn×4"
    assert variant_label({"name": "rope", "scaling": "yarn", "factor": 4.0, "yarn_ramp": "paper"}) == "rope+yarn_paper×4"
    assert variant_label({"name": "xpos", "scaling": "ntk", "factor": 2.0}) == "xpos+ntk×2"


# ---- llama3: Llama 3.1's blend of kept and divided frequencies ----------------------------------------


def llama3_frequency(i, s, L, low, high, base=10000.0, dh=DH):
    """Pair i's frequency as HF transformers' ``_compute_llama3_parameters`` states it, by wavelength: kept below
    L/high, divided by s above L/low, blended in between with smooth = (L/λ − low)/(high − low)."""
    th = theta(i, base, dh)
    wavelength = 2 * math.pi / th
    if wavelength < L / high:
        return th
    if wavelength > L / low:
        return th / s
    if high == low:  # (λ = L/low exactly: HF's 0/0; the step keeps it)
        return th
    smooth = (L / wavelength - low) / (high - low)
    return (1 - smooth) * th / s + smooth * th


@pytest.mark.parametrize("s, L, low, high", [(8.0, 128, 1.0, 4.0), (4.0, 512, 1.0, 4.0), (16.0, 64, 2.0, 8.0),
                                              (16.0, 128, 1.0, 1.0)])
def test_llama3_blends_kept_and_divided_frequencies(s, L, low, high):
    rope = scheme(scaling="llama3", factor=s, original_length=L, low_freq_factor=low, high_freq_factor=high)
    want = [llama3_frequency(i, s, L, low, high) for i in range(DH // 2)]
    assert 0 < sum(w == theta(i) for i, w in enumerate(want)) < DH // 2  # some pairs kept, some not: a real test
    check_tables(rope, POSITIONS, lambda p, i: p * want[i])  # no attention factor


def test_llama3_label_and_refusals():
    assert scheme(scaling="llama3", factor=8.0, original_length=128).config.label() == "+llama3×8"
    assert scheme(scaling="llama3", factor=16.0, original_length=128, high_freq_factor=1.0).config.label() == \
        "+llama3[1-1]×16"
    with pytest.raises(ValueError, match=r"^low_freq_factor=5.0: Llama 3's blend needs 0 < low_freq_factor <= "):
        scheme(scaling="llama3", factor=8.0, original_length=128, low_freq_factor=5.0)
    yarn = scheme(scaling="yarn", factor=8.0, original_length=128, high_freq_factor=1.0)  # carried, unused
    assert_close(yarn.rotation(torch.tensor(POSITIONS), torch.float64)[0],
                 scheme(scaling="yarn", factor=8.0, original_length=128).rotation(torch.tensor(POSITIONS), torch.float64)[0],
                 rtol=0, atol=0)
