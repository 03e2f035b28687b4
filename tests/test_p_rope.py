"""p-RoPE (Barbero et al. 2025, "Round and round we go! What makes Rotary Positional Encodings useful?", §6), registered
as ``p_rope``: RoPE that keeps the highest-frequency fraction p of its Dh/2 frequency pairs, the k = ⌊p·Dh/2⌋ fastest,
and leaves the others unrotated (frequency 0).

Every expected value here is written from the formula with python math or float64 torch, never through posbench's
rotary code: g_i = θ_i = base^(−2i/Dh) for i < k, 0 for the others; pair (i, i + Dh/2) of a head at position m turned
by m·g_i. With a scaling, θ_i is the method's frequency for the full head width and YaRN's factor multiplies every
dimension. Checked: scores and model logits against the formula at L and 4L; p = 1 is RoPE and p = 0 NoPE bit for bit;
the scalings on the kept pairs; scores a function of m − n; causality; a checkpoint round trip; the command line
(training, refusals, ``posbench eval`` with a scaling).
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.testing import assert_close

from helpers import (
    eval_here,
    kept_torch_state,
    nll_with_scheme,
    refused,
    rope_tables,
    run_into,
    snapshot,
    train_here,
    yarn_frequencies,
)
from posbench.config.schema import PosbenchConfig, finalize
from posbench.model import build
from posbench.model.build import build_model
from posbench.model.gpt import GPT
from posbench.schemes import PositionalScheme, build_scheme, variant_label
from posbench.schemes.rotary import PRoPE
from posbench.training import checkpoint

DH = 16  # head width of the unit tests (d_model 32, 2 heads): 8 frequency pairs
L = 16  # their "train length"
VOCAB = 40
PS = [0.75, 0.5, 0.7, 0.25, 1.0, 0.0]  # 0.7: p·Dh/2 = 5.6, where a floor (5) and a round (6) differ


def kept(p: float, dh: int = DH) -> int:
    """k = ⌊p·Dh/2⌋, counted exactly for p as written in decimal."""
    return math.floor(Fraction(str(p)) * (dh // 2))


def theta(dh: int = DH, base: float = 10000.0) -> list[float]:
    """RoPE's θ_i = base^(−2i/Dh), i = 0 … Dh/2 − 1 (RoFormer eq. 15)."""
    return [base ** (-2 * i / dh) for i in range(dh // 2)]


def p_rope_frequencies(p: float, dh: int = DH, thetas: list[float] | None = None) -> list[float]:
    """p-RoPE's g_i: θ_i (or the scaled ``thetas``) for the k fastest pairs, i < k = ⌊p·Dh/2⌋; 0 for the others."""
    thetas = theta(dh) if thetas is None else thetas
    return [t if i < kept(p, dh) else 0.0 for i, t in enumerate(thetas)]


def rotate_by_hand(x: torch.Tensor, positions: list[int], g: list[float], mscale: float = 1.0) -> torch.Tensor:
    """x: (..., T, Dh) float64 → pair (i, i + Dh/2) of position m turned by m·g_i, every dimension times mscale."""
    angles = torch.tensor([[m * gi for gi in g] for m in positions], dtype=torch.float64)  # (T, Dh/2)
    c, s = angles.cos(), angles.sin()
    x1, x2 = x[..., : len(g)], x[..., len(g):]
    return mscale * torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def scheme(p: float, **options) -> PRoPE:
    return build_scheme("p_rope", 2 * DH, 2, p=p, **options)


def rotated(s: PRoPE, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return s.rotate(q, k, s.rotation(pos, q.dtype))


def causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    """scores (..., T, T) → attention weights, key j > query i masked."""
    T = scores.shape[-1]
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1)


class NaivePRoPE(PositionalScheme):
    """p-RoPE from its formula, as the positional scheme of posbench's GPT: pair (i, i + Dh/2) of every query and key
    head turned by m·g_i (tables from python math), every dimension times ``mscale`` (YaRN's √(1/t))."""

    def __init__(self, g: list[float], mscale: float = 1.0):
        super().__init__(2 * len(g), 1)
        self.g, self.mscale = g, mscale

    def rotation(self, pos, dtype):
        return pos.tolist()

    def rotate(self, q, k, rotation):
        dtype = q.dtype
        q, k = q.to(torch.float64), k.to(torch.float64)
        return (rotate_by_hand(q, rotation, self.g, self.mscale).to(dtype),
                rotate_by_hand(k, rotation, self.g, self.mscale).to(dtype))


def model_spec(name: str = "p_rope", **options) -> dict:
    return {"vocab_size": VOCAB, "model": {"n_layer": 2, "n_head": 2, "d_model": 2 * DH, "d_ff": 4 * DH},
            "scheme": {"name": name, **options}}


def built(name: str = "p_rope", seed: int = 0, **options) -> GPT:
    torch.manual_seed(seed)
    return build_model(model_spec(name, **options)).eval()


def naive_twin(model: GPT, g: list[float], mscale: float = 1.0) -> GPT:
    """``model``'s weights, in its dtype, in a GPT whose scheme is :class:`NaivePRoPE`."""
    m = model_spec()["model"]
    twin = GPT(VOCAB, m["n_layer"], m["n_head"], m["d_model"], m["d_ff"], NaivePRoPE(g, mscale))
    twin.to(model.tok.weight.dtype)  # float64 weights load into float64 parameters
    twin.load_state_dict(model.state_dict())
    return twin.eval()


def tokens(T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


# ---- (1) the formula, in float64, at L and 4L ------------------------------------------------------


@pytest.mark.parametrize("T, start", [(L, 0), (4 * L, 0), (4 * L, 1000)])
@pytest.mark.parametrize("p", PS)
def test_scores_and_attention_match_the_formula(p, T, start):
    torch.manual_seed(11)
    q, k = torch.randn(1, 2, T, DH, dtype=torch.float64), torch.randn(1, 2, T, DH, dtype=torch.float64)
    positions = list(range(start, start + T))
    qr, kr = rotated(scheme(p), q, k, torch.tensor(positions))
    g = p_rope_frequencies(p)
    want_q, want_k = rotate_by_hand(q, positions, g), rotate_by_hand(k, positions, g)
    scores, want = qr @ kr.transpose(-1, -2) / math.sqrt(DH), want_q @ want_k.transpose(-1, -2) / math.sqrt(DH)
    assert_close(scores, want, rtol=1e-12, atol=1e-12)
    assert_close(causal_softmax(scores), causal_softmax(want), rtol=1e-12, atol=1e-12)
    # the dropped pairs carry no position: their part of a score is a plain dot product
    dropped = [i for i in range(DH // 2) if g[i] == 0.0]
    cols = dropped + [i + DH // 2 for i in dropped]
    assert torch.equal(qr[..., cols], q[..., cols]) and torch.equal(kr[..., cols], k[..., cols])


@pytest.mark.parametrize("T", [L, 4 * L], ids=["L", "4L"])
@pytest.mark.parametrize("p", [0.75, 0.7, 0.25])
def test_model_logits_match_a_gpt_with_the_formula(p, T):
    model = built(p=p).double()
    with torch.no_grad():  # sharper attention than at initialisation, so that every pair's rotation shows in the logits
        for name, w in model.named_parameters():
            if "qkv" in name:
                w.mul_(30.0)
    twin = naive_twin(model, p_rope_frequencies(p)).double()
    idx = tokens(T)
    with torch.no_grad():
        assert_close(model(idx), twin(idx), rtol=1e-10, atol=1e-10)
        # and not RoPE's or NoPE's logits: the formula is what tells them apart
        assert not torch.allclose(model(idx), naive_twin(model, theta()).double()(idx), rtol=1e-6, atol=1e-6)


def test_the_pairs_kept_are_counted_with_a_floor():
    """k = ⌊p·Dh/2⌋ as Gemma's ``rope_proportion`` and HF's ``proportional`` RoPE count it (0.7 of 8 pairs: 5, not a
    round's 6), but for decimal p exactly (0.58 of 50 pairs: 29, where ``int(0.58 * 100 // 2)`` gives 28)."""
    for dh, p, k in [(16, 0.75, 6), (16, 0.7, 5), (16, 0.3, 2), (16, 0.1, 0), (16, 0.125, 1), (16, 1.0, 8),
                     (16, 0.0, 0), (32, 0.5, 8), (64, 0.75, 24), (100, 0.58, 29), (128, 0.99, 63)]:
        assert build_scheme("p_rope", 2 * dh, 2, p=p).kept == k == kept(p, dh), (dh, p)


# ---- (2) p = 1 is RoPE and p = 0 NoPE, bit for bit ---------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"scaling": "yarn", "factor": 4.0, "original_length": L},
                                     {"scaling": "linear", "factor": 2.0, "original_length": L}, {"base": 500.0}])
def test_p_1_is_rope_bit_for_bit(options):
    idx = tokens(4 * L)
    with torch.no_grad():
        assert torch.equal(built("p_rope", p=1.0, **options)(idx), built("rope", **options)(idx))
    for dtype in (torch.float32, torch.bfloat16):
        pos = torch.tensor([*range(70), 4095, 16383])
        ours = scheme(1.0, **options).rotation(pos, dtype)
        rope = build_scheme("rope", 2 * DH, 2, **options).rotation(pos, dtype)
        assert all(torch.equal(a, b) for a, b in zip(ours, rope))


@pytest.mark.parametrize("p, options", [(0.0, {}), (0.1, {}),
                                        (0.0, {"scaling": "linear", "factor": 4.0, "original_length": L}),
                                        (0.0, {"scaling": "dynamic_ntk", "factor": 4.0, "original_length": L})])
def test_p_0_is_nope_bit_for_bit(p, options):
    """p = 0, and a p below 2/Dh (0.1·8 pairs keeps none), leave every pair unrotated: NoPE's logits exactly."""
    idx = tokens(4 * L)
    with torch.no_grad():
        assert torch.equal(built("p_rope", p=p, **options)(idx), built("nope")(idx))
    q = torch.randn(1, 2, 5, DH)
    assert scheme(p, **options).rotate(q, q, scheme(p, **options).rotation(torch.arange(5), q.dtype))[0] is q


def test_p_0_with_yarn_is_nope_with_yarns_temperature():
    model = built(p=0.0, scaling="yarn", factor=4.0, original_length=L).double()
    idx = tokens(2 * L)
    with torch.no_grad():
        assert_close(model(idx), naive_twin(model, [0.0] * (DH // 2), 0.1 * math.log(4.0) + 1).double()(idx),
                     rtol=1e-10, atol=1e-10)
        assert not torch.allclose(model(idx), built("nope").double()(idx))


# ---- (3) scalings: the kept pairs carry the scaled frequencies, the dropped ones none -----------------


SCALED = {  # scaling options → the method's frequencies θ'_i for the full head (Dh = 16), L = 16, s = 4, and its factor
    "linear": ({"scaling": "linear", "factor": 4.0, "original_length": L}, [t / 4.0 for t in theta()], 1.0),
    "ntk": ({"scaling": "ntk", "factor": 4.0, "original_length": L}, theta(base=10000.0 * 4.0 ** (DH / (DH - 2))), 1.0),
    "yarn": ({"scaling": "yarn", "factor": 4.0, "original_length": L}, yarn_frequencies(DH, 4.0, L),
             0.1 * math.log(4.0) + 1),
    "yarn-long": ({"scaling": "yarn", "factor": 8.0, "original_length": 512}, yarn_frequencies(DH, 8.0, 512),
                  0.1 * math.log(8.0) + 1),
}
POSITIONS = [0, 1, 2, 3, 31, 100, 511, 4095]


@pytest.mark.parametrize("method", list(SCALED))
@pytest.mark.parametrize("p", [0.75, 0.7, 0.25])
def test_scalings_turn_the_kept_pairs_at_the_scaled_frequencies(p, method):
    options, scaled, mscale = SCALED[method]
    g = p_rope_frequencies(p, thetas=scaled)
    s = scheme(p, **options)
    cos, sin = s.rotation(torch.tensor(POSITIONS), torch.float64)
    want_cos, want_sin = rope_tables(POSITIONS, lambda m, i: m * g[i], mscale)
    assert_close(cos, want_cos, rtol=0, atol=1e-9)
    assert_close(sin, want_sin, rtol=0, atol=1e-9)
    k = kept(p)
    assert (sin[1:, :k] != 0).all() and (sin[:, k: DH // 2] == 0).all() and (cos[:, k: DH // 2] == mscale).all()


def test_a_scaling_makes_a_difference_where_it_should():
    """YaRN at L = 512 keeps the fastest pairs and interpolates the slow ones: p-RoPE's kept slow pairs change with it,
    its dropped pairs stay at 0, and every dimension carries the temperature."""
    options, scaled, mscale = SCALED["yarn-long"]
    plain, yarn = scheme(0.75), scheme(0.75, **options)
    f_plain, f_yarn = plain.frequencies(torch.arange(4), DH)[0], yarn.frequencies(torch.arange(4), DH)[0]
    assert f_yarn[0] == f_plain[0] and f_yarn[5] < f_plain[5] and (f_yarn[6:] == 0).all() and (f_plain[6:] == 0).all()
    assert yarn.frequencies(torch.arange(4), DH)[1] == pytest.approx(mscale)


@pytest.mark.parametrize("T", [L, 4 * L])
def test_dynamic_ntk_uses_the_full_heads_base_for_the_window(T):
    s = scheme(0.5, scaling="dynamic_ntk", factor=4.0, original_length=L)
    s_T = max(1.0, 4.0 * T / L - 3.0)
    g = p_rope_frequencies(0.5, thetas=theta(base=10000.0 * s_T ** (DH / (DH - 2))))
    positions = list(range(T))
    cos, sin = s.rotation(torch.tensor(positions), torch.float64)
    want_cos, want_sin = rope_tables(positions, lambda m, i: m * g[i])
    assert_close(cos, want_cos, rtol=0, atol=1e-9)
    assert_close(sin, want_sin, rtol=0, atol=1e-9)


def test_a_training_config_with_a_scaling_resolves_and_builds():
    """``posbench train scheme=p_rope scheme.scaling=yarn scheme.factor=4``: original_length resolves to L, and the
    model it builds turns the kept pairs at YaRN's frequencies."""
    cfg = OmegaConf.structured(PosbenchConfig)
    cfg.scheme = {"name": "p_rope", "p": 0.75, "scaling": "yarn", "factor": 4.0}
    cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.d_ff = 2, 2, 2 * DH, 4 * DH
    cfg.train.seq_len = L
    config = OmegaConf.to_container(finalize(cfg, training=False), resolve=True)
    assert config["scheme"]["original_length"] == L and config["scheme"]["p"] == 0.75
    model = build_model(build.spec(config, VOCAB))
    cos, _ = model.scheme.rotation(torch.tensor([3]), torch.float64)
    g = p_rope_frequencies(0.75, thetas=yarn_frequencies(DH, 4.0, L))
    assert_close(cos[0, : DH // 2], torch.tensor([(0.1 * math.log(4.0) + 1) * math.cos(3 * f) for f in g],
                                                  dtype=torch.float64))


# ---- (4) scores depend on positions only through m − n ---------------------------------------------------


@pytest.mark.parametrize("options", [{}, SCALED["yarn"][0], SCALED["ntk"][0], SCALED["linear"][0]])
@pytest.mark.parametrize("p", [0.75, 0.25])
def test_scores_depend_only_on_relative_position(p, options):
    torch.manual_seed(12)
    s, T = scheme(p, **options), 4 * L
    q, k = torch.randn(1, 2, 1, DH, dtype=torch.float64), torch.randn(1, 2, 1, DH, dtype=torch.float64)
    qr, kr = rotated(s, q.expand(-1, -1, T, -1), k.expand(-1, -1, T, -1), torch.arange(T))
    scores = (qr @ kr.transpose(-1, -2))[0, 0]  # (T, T): the same vectors at every position
    for d in (0, 1, 5, T - 1):
        assert_close(torch.diagonal(scores, -d), torch.full((T - d,), scores[d, 0].item(), dtype=torch.float64))
    assert not torch.allclose(scores[5, 0], scores[6, 0])  # yet the distance matters
    q2, k2 = torch.randn(1, 2, T, DH, dtype=torch.float64), torch.randn(1, 2, T, DH, dtype=torch.float64)

    def scores_at(pos):  # (1, 2, T, T)
        qr, kr = rotated(s, q2, k2, pos)
        return qr @ kr.transpose(-1, -2)

    for shift in (1, 37, 5000):  # every window shifted: the same scores
        assert_close(scores_at(torch.arange(T) + shift), scores_at(torch.arange(T)))


# ---- (5) causality --------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [L, 4 * L])
def test_a_later_token_changes_no_earlier_logit(T):
    model = built(p=0.75)
    idx = tokens(T, seed=T)
    with torch.no_grad():
        full = model(idx)
        for t in sorted({1, T // 2, T - 1}):
            changed = idx.clone()
            changed[:, t] = (idx[:, t] + 1) % VOCAB
            out = model(changed)
            assert_close(out[:, :t], full[:, :t])
            assert not torch.allclose(out[:, t], full[:, t])


# ---- (6) a checkpoint round trip --------------------------------------------------------------------------


def test_checkpoint_round_trip_gives_identical_logits(tmp_path):
    cfg = OmegaConf.structured(PosbenchConfig)
    cfg.scheme = {"name": "p_rope", "p": 0.5}
    cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.d_ff = 2, 2, 2 * DH, 4 * DH
    cfg.train.seq_len = L
    config = OmegaConf.to_container(finalize(cfg, training=False), resolve=True)
    spec = build.spec(config, VOCAB)
    torch.manual_seed(0)
    model = build_model(spec).eval()
    checkpoint.save(tmp_path / "checkpoint.pt", model, spec, config, {}, step=0)
    state = checkpoint.read(tmp_path / "checkpoint.pt")
    assert state["spec"]["scheme"]["p"] == 0.5
    again = build.model_from(state)
    assert isinstance(again.scheme, PRoPE) and again.scheme.kept == 4
    idx = tokens(4 * L)
    yarn = {"scheme": {"scaling": "yarn", "factor": 4.0, "original_length": L}}
    scaled = build_model(spec, yarn)
    scaled.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(again(idx), model(idx))
        assert torch.equal(build.model_from(state, overrides=yarn)(idx), scaled.eval()(idx))


def test_config_checks_and_labels():
    assert PRoPE.Config().p == 0.75 and PRoPE.fine_tune_options == build_scheme("rope", 32, 2).fine_tune_options
    for bad in (1.5, -0.1, float("nan"), float("inf"), True, "0.5"):
        with pytest.raises(ValueError) as err:
            PRoPE.make_config(p=bad).resolve(L, L)
        assert str(err.value).startswith(f"p={bad!r}: "), str(err.value)
    for good in (0, 0.0, 1, 0.75):
        PRoPE.make_config(p=good).resolve(L, L)
    assert variant_label({"name": "p_rope", "p": 0.75}) == "p_rope+p0.75"
    assert variant_label({"name": "p_rope", "p": 0.5, "scaling": "yarn", "factor": 4.0}) == "p_rope+p0.5+yarn×4"
    assert variant_label({"name": "p_rope", "p": 1.0}) == "p_rope+p1"


# ---- (7) the command line -----------------------------------------------------------------------------------

EVAL = ["eval.lengths=[32,64]", "eval.max_tokens=256"]


@pytest.fixture(scope="module")
def p_rope_run(data_cache, tmp_path_factory) -> Path:
    """A finished ``posbench train debug=fast scheme=p_rope scheme.p=0.5`` run (L = 32, Dh = 32: 8 of 16 pairs turn),
    the command line's job trained in this process."""
    run = tmp_path_factory.mktemp("p-rope") / "run"
    with kept_torch_state():
        assert train_here(data_cache, run, "scheme=p_rope", "scheme.p=0.5", *EVAL)["status"] == "complete"
    return run


def test_p_rope_trains_from_the_command_line_as_the_formula_says(p_rope_run):
    rec = json.loads((p_rope_run / "results.json").read_text())
    assert rec["label"] == "p_rope+p0.5" and rec["config"]["scheme"]["p"] == 0.5
    dh = rec["config"]["model"]["d_model"] // rec["config"]["model"]["n_head"]
    want = nll_with_scheme(p_rope_run, rec, NaivePRoPE(p_rope_frequencies(0.5, dh)))
    assert [r["nll"] for r in rec["results"]] == pytest.approx(want, rel=1e-5)


def test_eval_applies_a_scaling_to_a_p_rope_run(p_rope_run, tmp_path, torch_state):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(p_rope_run, run)
    assert eval_here(f"run={run}", *EVAL, "scheme.scaling=yarn", "scheme.factor=4")["results"]
    rec = json.loads((run / "eval-p_rope+p0.5_yarnx4_at_eval-nonoverlapping-validation-1.json").read_text())
    assert rec["label"] == "p_rope+p0.5 (yarn×4 at eval)"
    assert rec["scheme_overrides"] == {"scaling": "yarn", "factor": 4.0, "original_length": 32}
    dh = rec["config"]["model"]["d_model"] // rec["config"]["model"]["n_head"]
    naive = NaivePRoPE(p_rope_frequencies(0.5, dh, yarn_frequencies(dh, 4.0, 32)), 0.1 * math.log(4.0) + 1)
    assert [r["nll"] for r in rec["results"]] == pytest.approx(nll_with_scheme(run, rec, naive), rel=1e-5)
    trained = json.loads((run / "results.json").read_text())
    assert all(a != b for a, b in zip((r["nll"] for r in rec["results"]), (r["nll"] for r in trained["results"])))


@pytest.mark.parametrize("value", ["1.5", "-0.1"])
def test_a_p_outside_0_1_is_refused_and_nothing_written(value, p_rope_run, posbench_here, data_cache, tmp_path):
    import shutil

    run = tmp_path / "existing"
    shutil.copytree(p_rope_run, run)
    before = snapshot(run)
    message = refused(run_into(posbench_here, data_cache, run, "scheme=p_rope", f"scheme.p={value}"), run, before)
    assert message.startswith(f"scheme.p={value}: ") and "[0, 1]" in message, message
    fresh = tmp_path / "never"
    assert run_into(posbench_here, data_cache, fresh, "scheme=p_rope", f"scheme.p={value}").returncode == 2
    assert not fresh.exists()
