"""The positional schemes against their papers' formulas, computed naively here (python math, loops).

* sinusoidal — Vaswani et al. 2017, §3.5
* RoPE — Su et al. 2021 (RoFormer): scores depend on positions only through m − n; rotations keep norms
* ALiBi — Press et al. 2022: slopes from the paper's ``get_slopes``; bias −m_h · (i − j) for j ≤ i, through
  ``score_mod`` at score 0 on broadcast positions (as the dense kernel calls it) and on 0-d scalars (as Flex does)
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from posbench.schemes import SCHEMES, PositionalScheme, build_scheme
from posbench.schemes.absolute import Learned, Sinusoidal
from posbench.schemes.alibi import ALiBi, alibi_slopes
from posbench.schemes.rotary import RoPE

# ---- sinusoidal -----------------------------------------------------------------------------------


def naive_sinusoidal(positions, d, base=10000.0):
    """PE(p, 2i) = sin(p / base^(2i/d)), PE(p, 2i+1) = cos(p / base^(2i/d)); a list of rows."""
    rows = []
    for p in positions:
        row = [0.0] * d
        for i in range(d // 2):
            angle = p / base ** (2 * i / d)
            row[2 * i], row[2 * i + 1] = math.sin(angle), math.cos(angle)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("d", [2, 16, 32])
def test_sinusoidal_matches_vaswani_formula(d):
    positions = [*range(40), 127, 128, 1000, 4095, 16383]
    scheme = Sinusoidal(d, 2 if d > 2 else 1)
    pos = torch.tensor(positions)
    x = torch.zeros(3, len(positions), d)
    out = scheme.embed(x, pos)  # (B, T, D): zero embeddings + PE
    expected = naive_sinusoidal(positions, d).float()
    assert out.shape == (3, len(positions), d)
    for b in range(3):
        assert_close(out[b], expected, atol=2e-6, rtol=0)
    # the PE is added to the token embeddings, not substituted (the sqrt(d) scale is the model's, for every scheme)
    x = torch.randn(2, len(positions), d)
    assert_close(scheme.embed(x, pos), x + expected, atol=1e-5, rtol=0)


def test_sinusoidal_base_is_the_wavelength_base():
    positions = list(range(0, 300, 7))
    scheme = build_scheme("sinusoidal", 8, 2, base=500.0)
    out = scheme.embed(torch.zeros(1, len(positions), 8), torch.tensor(positions))[0]
    assert_close(out, naive_sinusoidal(positions, 8, base=500.0).float(), atol=2e-6, rtol=0)


def test_sinusoidal_needs_even_width():
    with pytest.raises(ValueError):
        Sinusoidal(15, 3)


# ---- RoPE -----------------------------------------------------------------------------------------


def naive_rope(x, p, base=10000.0):
    """Rotate each pair (i, i + Dh/2) of vector x (python list, length Dh) by angle p · base^(−2i/Dh)."""
    dh = len(x)
    half = dh // 2
    out = list(x)
    for i in range(half):
        a = p * base ** (-2 * i / dh)
        out[i] = x[i] * math.cos(a) - x[i + half] * math.sin(a)
        out[i + half] = x[i] * math.sin(a) + x[i + half] * math.cos(a)
    return out


def rotate(scheme, q, k, pos):
    """The scheme's rotation of q and k at positions pos: its tables, then its rotate hook."""
    return scheme.rotate(q, k, scheme.rotation(pos, q.dtype))


def rope_score(scheme, q, k, m, n):
    """q·k after rotating q (B, H, 1, Dh) to position m and k to position n → (B, H)."""
    qm, _ = rotate(scheme, q, q, torch.tensor([m]))
    _, kn = rotate(scheme, k, k, torch.tensor([n]))
    return (qm * kn).sum(-1)[..., 0]


@pytest.mark.parametrize("m, n, s", [(0, 0, 5), (5, 2, 0), (5, 2, 11), (17, 3, 1000), (3, 17, 250),
                                     (100, 0, 4000), (1, 1, 12345), (4095, 4000, 96)])
def test_rope_score_depends_only_on_relative_position(m, n, s):
    torch.manual_seed(m * 7919 + n * 31 + s)
    scheme = RoPE(d_model=64, n_head=4)  # Dh = 16
    q, k = torch.randn(2, 4, 1, 16, dtype=torch.float64), torch.randn(2, 4, 1, 16, dtype=torch.float64)
    assert_close(rope_score(scheme, q, k, m + s, n + s), rope_score(scheme, q, k, m, n))
    # ... and the positions do matter (a scheme that rotated nothing would pass the line above)
    if m != n or s:
        assert not torch.allclose(rope_score(scheme, q, k, m, n), rope_score(scheme, q, k, m, n + 1))


def test_rope_matches_roformer_rotation():
    torch.manual_seed(0)
    scheme = RoPE(d_model=32, n_head=2)  # Dh = 16
    T = 9
    pos = torch.tensor([0, 1, 2, 3, 10, 100, 511, 512, 5000])
    q, k = torch.randn(1, 2, T, 16, dtype=torch.float64), torch.randn(1, 2, T, 16, dtype=torch.float64)
    qr, kr = rotate(scheme, q, k, pos)
    for h in range(2):
        for t in range(T):
            p = int(pos[t])
            assert_close(qr[0, h, t], torch.tensor(naive_rope(q[0, h, t].tolist(), p), dtype=torch.float64))
            assert_close(kr[0, h, t], torch.tensor(naive_rope(k[0, h, t].tolist(), p), dtype=torch.float64))


def test_rope_base_is_used():
    torch.manual_seed(1)
    scheme = build_scheme("rope", 16, 2, base=100.0)
    x = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    qr, _ = rotate(scheme, x, x, torch.tensor([7]))
    assert_close(qr[0, 0, 0], torch.tensor(naive_rope(x[0, 0, 0].tolist(), 7, base=100.0), dtype=torch.float64))


def test_rope_preserves_norms_and_is_identity_at_zero():
    torch.manual_seed(2)
    scheme = RoPE(d_model=64, n_head=4)
    pos = torch.tensor([0, 1, 2, 50, 999, 8191])
    q, k = torch.randn(3, 4, 6, 16), torch.randn(3, 4, 6, 16)
    qr, kr = rotate(scheme, q, k, pos)
    assert qr.shape == q.shape and kr.shape == k.shape
    assert_close(qr.norm(dim=-1), q.norm(dim=-1))
    assert_close(kr.norm(dim=-1), k.norm(dim=-1))
    assert_close(qr[:, :, 0], q[:, :, 0])  # position 0: no rotation
    assert not torch.allclose(qr[:, :, 1:], q[:, :, 1:])


# ---- ALiBi ----------------------------------------------------------------------------------------


def get_slopes(n):
    """The ALiBi paper's get_slopes, written from its description (Press et al. 2022)."""
    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    p = 2 ** math.floor(math.log2(n))
    return power_of_2(p) + get_slopes(2 * p)[0::2][: n - p]


def test_alibi_slopes_eight_heads():
    assert_close(torch.tensor(alibi_slopes(8), dtype=torch.float64),
                 torch.tensor([2.0**-h for h in range(1, 9)], dtype=torch.float64))


def test_alibi_slopes_six_heads_by_hand():
    # p = 4: 2^-2, 2^-4, 2^-6, 2^-8; then every other slope of the 8-head sequence: 2^-1, 2^-3
    assert_close(torch.tensor(alibi_slopes(6), dtype=torch.float64),
                 torch.tensor([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3], dtype=torch.float64))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 12, 16, 20, 24, 32, 48])
def test_alibi_slopes_match_paper_get_slopes(n):
    slopes = alibi_slopes(n)
    assert len(slopes) == n
    assert_close(torch.tensor(slopes, dtype=torch.float64), torch.tensor(get_slopes(n), dtype=torch.float64))


def test_alibi_scheme_uses_paper_slopes():
    for n in (6, 8, 12):
        assert_close(ALiBi(d_model=8 * n, n_head=n).slopes.double(), torch.tensor(get_slopes(n), dtype=torch.float64))


def bias_of(scheme, q_pos, k_pos, score=0.0):
    """The scheme's score_mod on broadcast positions, as the dense kernel calls it → (H, Tq, Tk)."""
    h = torch.arange(scheme.n_head)[:, None, None]
    return scheme.score_mod(torch.tensor(score), h, q_pos[None, :, None], k_pos[None, None, :])


@pytest.mark.parametrize("n_head", [4, 6, 8])
def test_alibi_bias_is_minus_slope_times_distance(n_head):
    scheme = ALiBi(d_model=4 * n_head, n_head=n_head)
    slopes = get_slopes(n_head)
    T = 20
    bias = bias_of(scheme, torch.arange(T), torch.arange(T))
    assert bias.shape == (n_head, T, T)
    for h in range(n_head):
        for i in range(T):
            for j in range(i + 1):
                assert bias[h, i, j].item() == pytest.approx(-slopes[h] * (i - j), rel=1e-6, abs=1e-7)


def test_alibi_bias_of_a_query_block_uses_absolute_positions():
    """A block of queries (positions 7…11) against keys 0…11 gives the same rows as the full matrix."""
    scheme = ALiBi(d_model=24, n_head=6)
    full = bias_of(scheme, torch.arange(12), torch.arange(12))  # (H, 12, 12)
    block = bias_of(scheme, torch.arange(7, 12), torch.arange(12))  # (H, 5, 12)
    assert block.shape == (6, 5, 12)
    assert_close(block, full[:, 7:12])
    shifted = bias_of(scheme, torch.arange(100, 112), torch.arange(100, 112))  # only i − j matters
    assert_close(shifted, full)


def test_alibi_score_mod_is_additive_and_takes_flex_scalars():
    """score + bias for any score; with 0-d int32 head and positions (FlexAttention's call) the same numbers."""
    scheme = ALiBi(d_model=32, n_head=4)
    slopes = get_slopes(4)
    scores = torch.randn(4, 9, 9, dtype=torch.float64)
    pos = torch.arange(30, 39)
    h = torch.arange(4)[:, None, None]
    assert_close(scheme.score_mod(scores, h, pos[None, :, None], pos[None, None, :]), scores + bias_of(scheme, pos, pos))
    for head, i, j in [(0, 5, 2), (3, 100, 0), (1, 7, 7), (2, 4096, 4000)]:
        got = scheme.score_mod(torch.tensor(0.5), torch.tensor(head, dtype=torch.int32), torch.tensor(i, dtype=torch.int32),
                               torch.tensor(j, dtype=torch.int32))
        assert got.dim() == 0 and got.item() == pytest.approx(0.5 - slopes[head] * (i - j), rel=1e-6)


@pytest.mark.parametrize("n_head", [4, 6])
def test_alibi_bias_is_key_only_up_to_a_per_query_constant(n_head):
    """key_only_bias: bias(h, i, j) − bias(h, c, j) is the same for every key j (ahead of i too), for any c,
    which is what lets the attention fold the key-only bias(h, c, j) into q and k (posbench/attention/dispatch.py)."""
    scheme = ALiBi(d_model=4 * n_head, n_head=n_head)
    assert scheme.has_bias and scheme.key_only_bias
    pos = torch.arange(40) * 3 + 5
    full = bias_of(scheme, pos, pos).double()  # (H, T, T)
    for c in (0, 17, 500):
        row = bias_of(scheme, torch.tensor([c]), pos).double()  # (H, 1, T)
        difference = full - row  # (H, T, T): must not vary along keys
        assert_close(difference, difference[:, :, :1].expand_as(difference), atol=1e-4, rtol=1e-6)


# ---- registry -------------------------------------------------------------------------------------


def test_registry_has_the_four_schemes_and_nope():
    assert {"sinusoidal", "learned", "rope", "alibi"} <= set(SCHEMES)
    for name, cls in SCHEMES.items():
        assert issubclass(cls, PositionalScheme), name
        scheme = build_scheme(name, 16, 2, **({"max_positions": 64} if name == "learned" else {}))
        assert isinstance(scheme, cls)
        # exactly one hook is non-trivial per scheme (docs/design.md §3): at most one, for every scheme
        x, q = torch.randn(1, 4, 16), torch.randn(1, 2, 4, 8)
        pos = torch.arange(1, 5)
        embeds = not torch.equal(scheme.embed(x, pos), x)
        rotates = not torch.equal(rotate(scheme, q, q, pos)[0], q)
        biases = scheme.has_bias
        assert embeds + rotates + biases <= 1, name
        # has_bias says whether score_mod adds anything, so the attention never needs to probe it
        overridden = cls.score_mod is not PositionalScheme.score_mod
        assert cls.has_bias == overridden, name
        assert not cls.key_only_bias or cls.has_bias, name
        if not cls.has_bias:
            scores = torch.randn(2, 4, 4)
            assert torch.equal(bias_of(scheme, pos, pos, 0.0), torch.tensor(0.0)) and torch.equal(
                scheme.score_mod(scores, torch.tensor(0), pos[:, None], pos[None]), scores)


def test_build_scheme_unknown_name_lists_choices():
    with pytest.raises(ValueError) as info:
        build_scheme("xpos-typo", 16, 2)
    for name in SCHEMES:
        assert name in str(info.value)


def test_learned_table_needs_rows():
    with pytest.raises(ValueError):
        Learned(16, 2)  # max_positions None: unresolved
    table = Learned(16, 2, Learned.Config(max_positions=10))
    rows = table.embed(torch.zeros(1, 10, 16), torch.arange(10))[0]  # (10, 16)
    assert rows.shape == (10, 16) and rows.abs().sum() > 0
    again = table.embed(torch.zeros(1, 3, 16), torch.tensor([9, 0, 4]))[0]
    assert_close(again, rows[[9, 0, 4]])  # a row per absolute position
    with pytest.raises(IndexError):
        table.embed(torch.zeros(1, 11, 16), torch.arange(11))  # past the table


def test_variant_labels_say_what_the_name_does_not():
    from posbench.schemes import variant_label

    assert variant_label({"name": "t5", "num_buckets": 32}) == "t5"
    assert variant_label({"name": "rope", "base": 10000.0, "scaling": "none", "factor": 1.0}) == "rope"
    assert variant_label({"name": "rope", "scaling": "linear", "factor": 4.0}) == "rope+linear×4"
    assert variant_label({"name": "rope", "scaling": "yarn", "factor": 16.0, "original_length": 128}) == "rope+yarn×16"
    assert variant_label({"name": "gone", "x": 1}) == "gone"  # a record of a scheme this posbench lacks
