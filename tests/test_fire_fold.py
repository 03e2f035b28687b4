"""FIRE's MLP folded into a piecewise-linear function of its one input (``Fire.fold``): kinks, slopes and intercepts
against an independent float64 MLP; the fold's ``score_mod`` and ``pair_bias`` (sheared blocks, looked-up segments)
against the MLP's bias, for parameters with negative, zero and equal-kink units; the training path unchanged; the
model's CPU evaluation past the threshold (the dense kernel with the fold) against the MLP's; compiled Flex on CPU
with the fold's score_mod against the dense bias.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from helpers import paper_bias
from posbench.attention import choice, dispatch, flex
from posbench.model.gpt import GPT
from posbench.schemes import build_scheme
from posbench.schemes.fire import Fire

H, DH, W = 4, 8, 16


def awkward_fire(seed: int = 0, threshold: int = 8, dtype=torch.float64) -> Fire:
    """A FIRE whose MLP has units of both signs, three constant units (W1 = 0, one with b1 < 0), two pairs of units
    with equal kinks (one pair of opposite signs), and kinks inside the x range the positions reach (0 … ~1)."""
    torch.manual_seed(seed)
    s = build_scheme("fire", d_model=H * DH, n_head=H, mlp_width=W, threshold=threshold).to(dtype)
    with torch.no_grad():
        w1, b1 = s.mlp[0].weight[:, 0], s.mlp[0].bias
        w1.copy_(torch.randn(W, dtype=dtype) * 2)
        kinks = torch.rand(W, dtype=dtype) * 1.2 - 0.1  # mostly within 0 … 1.1
        b1.copy_(-kinks * w1)
        w1[0] = w1[1] = w1[2] = 0.0
        b1[0], b1[1], b1[2] = 0.7, -0.4, 0.0
        w1[3], w1[4] = 1.5, -0.5  # units 3 and 4: the same kink, opposite slopes
        b1[3], b1[4] = -1.5 * 0.3, 0.5 * 0.3
        w1[5], w1[6] = 2.0, 3.0  # units 5 and 6: the same kink, same sign
        b1[5], b1[6] = -2.0 * 0.55, -3.0 * 0.55
        s.mlp[2].weight.copy_(torch.randn(H, W, dtype=dtype))
        s.mlp[2].bias.copy_(torch.randn(H, dtype=dtype))
        s.c.fill_(-0.3)  # ψ takes |c·x|: a negative c is allowed
    return s


def mlp_f64(s: Fire, x: torch.Tensor) -> torch.Tensor:
    """f_θ(x) from float64 copies of the weights with torch.nn.functional: x (N,) → (H, N)."""
    w1, b1 = s.mlp[0].weight.detach().double().clone(), s.mlp[0].bias.detach().double().clone()
    w2, b2 = s.mlp[2].weight.detach().double().clone(), s.mlp[2].bias.detach().double().clone()
    return F.linear(F.relu(F.linear(x.double()[:, None], w1, b1)), w2, b2).T


def fold_at(folded, x: torch.Tensor) -> torch.Tensor:
    """The fold evaluated at x (N,) → (H, N): segment #{kinks < x}, then slope·x + intercept."""
    kinks, slopes, intercepts = folded
    seg = (x[:, None] > kinks[None, :]).sum(-1)  # (N,)
    return slopes[:, seg] * x + intercepts[:, seg]


def test_the_fold_is_the_mlp_everywhere_kinks_included():
    s = awkward_fire()
    kinks, slopes, intercepts = s.fold()
    assert kinks.shape == (W,) and slopes.shape == intercepts.shape == (H, W + 1)
    assert (kinks[1:] >= kinks[:-1]).all() and torch.isinf(kinks[-3:]).all()  # the three W1 = 0 units last
    finite = kinks[torch.isfinite(kinks)]
    assert (finite[1:] == finite[:-1]).sum() >= 2  # the equal kinks kept
    x = torch.cat([torch.linspace(-3, 3, 2001, dtype=torch.float64), finite, finite + 1e-9, finite - 1e-9,
                   torch.tensor([0.0, 1e3, -1e3, 1e6, -1e6], dtype=torch.float64)])
    want = mlp_f64(s, x)
    assert_close(fold_at((kinks, slopes, intercepts), x), want, rtol=1e-12, atol=1e-11)
    # a wrong segment (one kink off) is caught: the test can fail
    off = (kinks, slopes.roll(1, dims=1), intercepts.roll(1, dims=1))
    assert (fold_at(off, x) - want).abs().max() > 1e-3


def test_the_fold_in_float32_is_the_mlp_to_rounding():
    s = awkward_fire(dtype=torch.float32)
    folded = s.fold()
    assert all(t.dtype == torch.float32 for t in folded)
    x = torch.rand(5000, dtype=torch.float32) * 1.5
    assert_close(fold_at(folded, x).double(), mlp_f64(s, x), rtol=1e-5, atol=1e-5)


def every_pair(s: Fire, q_pos, k_pos, method) -> torch.Tensor:
    """A score_mod-like method at score 0 on every (query, key) pair, broadcast → (H, Tq, Tk)."""
    heads = torch.arange(H)[:, None, None]
    zero = torch.zeros((), dtype=s.c.dtype)
    return method(zero, heads, q_pos[None, :, None], k_pos[None, None, :]).expand(H, q_pos.numel(), k_pos.numel())


POSITIONS = {
    "square": (torch.arange(40), torch.arange(40)),
    "block": (torch.arange(24, 31), torch.arange(0, 31)),  # a dense kernel's block: keys up to its last query
    "shifted": (torch.arange(1000, 1013), torch.arange(990, 1100)),  # later keys too (their bias is defined)
    "gaps": (torch.tensor([0, 3, 4, 9, 30, 31, 60]), torch.tensor([0, 1, 5, 9, 31, 44])),
}


@pytest.mark.parametrize("rows", [3, 64])  # sheared blocks of 3 rows (several per call) or one block
@pytest.mark.parametrize("where", sorted(POSITIONS))
def test_score_mod_and_pair_bias_are_the_mlps_bias(monkeypatch, rows, where):
    """No gradients, float64: the fold's score_mod and pair_bias (sheared for consecutive positions, looked up for
    others) against the paper's formula (tests/helpers.py) and the unrolled MLP."""
    monkeypatch.setattr(Fire, "FOLD_ROWS", rows)
    q, k = POSITIONS[where]
    s = awkward_fire()
    with torch.no_grad():
        s.multiplier.fill_(0.8)  # L_thr = 6.4: most queries past it
        want = s.mlp_bias(q, k)  # (H, Tq, Tk): the MLP as matmuls
        pb, sm, mlp = s.pair_bias(q, k), every_pair(s, q, k, s.score_mod), every_pair(s, q, k, s.score_mod_mlp)
    assert pb.shape == sm.shape == (H, q.numel(), k.numel())
    for got in (pb, sm, mlp):
        assert_close(got, want, rtol=1e-12, atol=1e-12)
    if where == "square":
        assert_close(pb, paper_bias("fire", s, q).detach(), rtol=1e-9, atol=1e-9)


class SquareRootFire(Fire):
    """FIRE with ψ(x) = √|c·x| (a monotone ψ of another shape): what a variant of FIRE changes in one place."""

    def psi(self, x):
        return (self.c * x.to(self.c.dtype)).abs().sqrt()


def test_the_sheared_bias_reads_x_from_the_one_definition_of_the_mlps_input():
    """The sheared layout (consecutive positions) takes x = ψ(i − j) / ψ(max(L_thr, i)) from :meth:`Fire.psi` and
    :meth:`Fire.normaliser`, as ``mlp_input`` does: a FIRE whose ψ is redefined gets its sheared bias from the new ψ,
    equal to the MLP's bias at the new x (and unlike the original FIRE's), to 1e-12 in float64."""
    q, k = torch.arange(24, 31), torch.arange(0, 31)  # a dense kernel's block
    base = awkward_fire()
    other = SquareRootFire(H * DH, H, base.config).to(torch.float64)
    other.load_state_dict(base.state_dict())
    with torch.no_grad():
        sheared, want = other.sheared_bias(q, k, other.fold()), other.looked_up_bias(q, k, other.fold())
        assert_close(sheared, want, rtol=1e-12, atol=1e-12)
        assert_close(sheared, other.mlp_bias(q, k), rtol=1e-12, atol=1e-12)
        assert not torch.allclose(sheared, base.sheared_bias(q, k, base.fold()))


def test_float32_pair_bias_is_the_float64_bias_to_rounding():
    s64 = awkward_fire()
    s32 = awkward_fire().float()
    pos = torch.arange(300)
    with torch.no_grad():
        s64.multiplier.fill_(10.0)  # L_thr = 80
        s32.multiplier.fill_(10.0)
        want = s64.mlp_bias(pos, pos)
        assert_close(s32.pair_bias(pos, pos).double(), want, rtol=1e-5, atol=2e-5)
        assert_close(every_pair(s32, pos, pos, s32.score_mod).double(), want, rtol=1e-5, atol=2e-5)


def test_with_gradients_the_bias_is_the_mlps_and_trains():
    """Training's path is the MLP's, bit for bit, with gradients to every parameter; so is score_mod's."""
    s = awkward_fire(dtype=torch.float32)
    pos = torch.arange(30)
    got = s.pair_bias(pos, pos)
    assert got.grad_fn is not None and torch.equal(got, s.mlp_bias(pos, pos))
    assert torch.equal(every_pair(s, pos, pos, s.score_mod), every_pair(s, pos, pos, s.score_mod_mlp))
    got.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in s.parameters())


def test_the_fold_follows_the_parameters():
    """An optimizer step (in place) or a load changes the parameters: the next bias is folded from the new ones."""
    s = awkward_fire()
    pos = torch.arange(20)
    opt = torch.optim.SGD(s.parameters(), lr=0.5)
    with torch.no_grad():
        before = s.pair_bias(pos, pos)
    s.mlp_bias(pos, pos).sum().backward()
    opt.step()
    with torch.no_grad():
        after, want = s.pair_bias(pos, pos), s.mlp_bias(pos, pos)
        assert (after - before).abs().max() > 1e-3
        assert_close(after, want, rtol=1e-12, atol=1e-12)
        s.load_state_dict(awkward_fire(seed=5).state_dict())
        assert_close(every_pair(s, pos, pos, s.score_mod), s.mlp_bias(pos, pos), rtol=1e-12, atol=1e-12)
        before = s.pair_bias(pos, pos)
        s.mlp[2].bias.data += 1.0  # (a write that leaves the parameter's version alone)
        assert_close(s.pair_bias(pos, pos), before + 1.0, rtol=1e-12, atol=1e-12)
        s.to(torch.float32)
        assert s.pair_bias(pos, pos).dtype == torch.float32
        assert_close(s.pair_bias(pos, pos).double(), s.double().mlp_bias(pos, pos), rtol=1e-6, atol=1e-6)


def fire_model(T_thr: int = 8, dtype=torch.float32) -> GPT:
    torch.manual_seed(0)
    schemes = [awkward_fire(seed=i, threshold=T_thr, dtype=dtype) for i in range(2)]
    return GPT(64, 2, H, H * DH, 64, schemes).to(dtype).eval()


@pytest.mark.parametrize("T", [40, 200])
def test_evaluation_past_the_threshold_is_the_mlps(monkeypatch, T):
    """The model's CPU evaluation at T past its threshold (the dense kernel, its masks from the fold) against the same
    model whose bias is the MLP (the unfolded matmul)."""
    net = fire_model()
    idx = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(T))
    kernels = []
    choose = choice.choose_kernel
    monkeypatch.setattr(dispatch, "choose_kernel", lambda *a, **k: kernels.append(choose(*a, **k)) or kernels[-1])
    with torch.no_grad():
        got = net(idx)  # (2, T, V)
    assert kernels and set(kernels) == {"dense"}
    monkeypatch.setattr(Fire, "pair_bias", lambda self, q, k, dtype=torch.float32: self.mlp_bias(q, k))
    with torch.no_grad():
        want = net(idx)
    assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - net.double()(idx).float()).abs().max() < 1e-4  # and float64's


@pytest.mark.skipif(flex.flex_attention is None, reason="FlexAttention needs torch >= 2.5")
def test_compiled_flex_on_cpu_with_the_folds_score_mod_is_the_dense_bias(monkeypatch):
    """Compiled Flex (CPU, no gradients) with FIRE's own score_mod, the fold (the MLP's unrolled sum made to fail, so
    it cannot be what ran), against the dense kernel's bias and a float64 attention; then again after the parameters
    change, through a new context (which refreshes the fold)."""
    if not flex.cpu_compiles:
        pytest.skip("FlexAttention does not compile on this machine")
    flex.reset_compiled()  # (a dynamic-shape variant left by earlier tests did not compile on CPU in torch 2.13)
    s, T = awkward_fire(dtype=torch.float32), 48
    pos = torch.arange(T)
    q, k, v = (torch.randn(1, H, T, DH, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def reference():
        bias = s.mlp_bias(pos, pos).double()  # (H, T, T)
        scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(DH) + bias
        return scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1) @ v.double()

    def fail(*args):
        raise AssertionError("the unrolled MLP ran inside Flex")

    for step in range(2):
        with torch.no_grad():
            dense = dispatch.attend(q, k, v, dispatch.context(s, pos, H, kernel="dense"))
            ctx = dispatch.context(s, pos, H, kernel="flex")
            assert ctx.table is None  # Flex calls the scheme's score_mod
            with monkeypatch.context() as m:
                m.setattr(Fire, "score_mod_mlp", fail)
                got = dispatch.attend(q, k, v, ctx)
            assert flex.cpu_compiles, "Flex fell back to the dense kernel"
            want = reference()
        assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
        assert_close(dense.double(), want, rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            s.mlp[2].weight.mul_(-1.5)  # the next context must fold the new weights
            s.mlp[0].bias.add_(0.1)
    flex.reset_compiled()
