"""One model recipe for every scheme (docs/design.md §2): a comparison differs in positions only.

* after the same ``torch.manual_seed`` every parameter outside the scheme is bit-identical whichever scheme is
  built, and the learned table is drawn from a stream of its own (not a copy of another parameter's values);
* token embeddings are multiplied by sqrt(D) for every scheme, before the scheme adds any positions, in the GPT
  block; in the Llama block (``model.block=llama``) they are not, and its weights start as Llama's, none of them
  scaled by depth, unless ``model.scale_embeddings`` says otherwise;
* the model never depends on evaluation settings: two runs that differ only in ``eval.lengths`` train the
  same weights and log the same losses.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from omegaconf import OmegaConf
from torch.testing import assert_close

from helpers import train_here
from posbench.config.schema import PosbenchConfig, finalize, training_options
from posbench.model.build import build_model, model_spec
from posbench.schemes import SCHEMES, build_scheme

ALL = sorted(SCHEMES)
VOCAB = 61
L = 16  # train length of the configs below; the learned table gets its default size


def config(name: str, d_model: int = 32, scale_embeddings: bool | None = None, block: str = "gpt",
           n_layer: int = 2) -> dict:
    """A resolved config (plain dict) as ``posbench train`` records it: the schema's defaults, a small model."""
    cfg = OmegaConf.structured(PosbenchConfig)
    cfg.scheme = {"name": name}
    cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.d_ff = n_layer, 2, d_model, 2 * d_model
    cfg.model.block = block
    cfg.train.seq_len = L
    if scale_embeddings is not None:
        cfg.model.scale_embeddings = scale_embeddings
    return OmegaConf.to_container(finalize(cfg), resolve=True)


def built(name: str, seed: int = 0, **options) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(model_spec(config(name, **options), VOCAB)).eval()


def scheme_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if n.startswith("scheme.")}


def other_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if not n.startswith("scheme.")}


# ---- the same non-positional weights for every scheme ---------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_non_positional_parameters_are_bit_identical_to_nope(name):
    torch.manual_seed(0)
    nope = build_model(model_spec(config("nope"), VOCAB))
    after_nope = torch.get_rng_state()
    torch.manual_seed(0)
    model = build_model(model_spec(config(name), VOCAB))
    after = torch.get_rng_state()
    expected, got = other_params(nope), other_params(model)
    assert list(got) == list(expected), f"{name}: other parameter names than nope's"
    differ = [n for n in expected if not torch.equal(got[n], expected[n])]
    assert not differ, f"{name}: these parameters differ from nope's after the same torch.manual_seed: {differ}"
    # what the model draws next (dropout masks) does not depend on the scheme either
    assert torch.equal(after, after_nope), f"{name}: building the model left torch's generator elsewhere than nope's"


def test_learned_table_is_drawn_from_a_stream_of_its_own():
    model = built("learned")
    (name, table), = scheme_params(model).items()
    assert table.shape == (16 * L, 32), "default table: 16·L rows, whatever the evaluation lengths"
    flat = table.detach().flatten()
    for other, p in other_params(model).items():
        values = p.detach().flatten()
        k = min(len(flat), len(values))
        assert not torch.equal(flat[:k], values[:k]), f"{name} starts as a copy of {other}"
        if p.dim() == 2 and p.shape[1] == table.shape[1]:  # same width: no row of the table is a row of p
            assert not (table[:, None, :] == p[None, :, :]).all(-1).any(), f"{name} shares a row with {other}"
    assert 0.01 < flat.std().item() < 0.04, "the table starts N(0, 0.02), as GPT-2's"
    # not the global stream itself: building the scheme straight after the seed gives another table …
    torch.manual_seed(0)
    direct = build_scheme("learned", 32, 2, max_positions=16 * L)
    assert not torch.equal(next(direct.parameters()), table), "the table was drawn from the global stream"
    # … but its stream is seeded from the global one: another model seed, another table
    assert not torch.equal(scheme_params(built("learned", seed=1))[name], table)


# ---- one embedding scale ---------------------------------------------------------------------------


def vaswani(T: int, d: int, base: float = 10000.0) -> torch.Tensor:
    """PE(p, 2i) = sin(p / base^(2i/d)), PE(p, 2i+1) = cos(p / base^(2i/d)) (Vaswani et al. 2017, §3.5), by loops."""
    pe = [[0.0] * d for _ in range(T)]
    for p in range(T):
        for i in range(d // 2):
            angle = p / base ** (2 * i / d)
            pe[p][2 * i], pe[p][2 * i + 1] = math.sin(angle), math.cos(angle)
    return torch.tensor(pe, dtype=torch.float64)


def first_layer_input(model, idx: torch.Tensor) -> torch.Tensor:
    """What the first block receives: token embeddings, scaled, plus the scheme's absolute positions."""
    seen = []
    handle = model.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    with torch.no_grad():
        model(idx)
    handle.remove()
    return seen[0]  # (B, T, D)


def absolute_positions(name: str, model, T: int, d: int) -> torch.Tensor:
    """What the scheme should add to the embeddings at positions 0…T−1, computed here: (T, D)."""
    if name == "sinusoidal":
        return vaswani(T, d)
    if name == "learned":
        (table,) = scheme_params(model).values()
        return table.detach()[:T].double()
    return torch.zeros(T, d, dtype=torch.float64)  # rope, alibi, nope: positions act inside attention only


@pytest.mark.parametrize("d_model", [32, 48])
@pytest.mark.parametrize("name", ALL)
def test_token_embeddings_are_scaled_by_sqrt_d_for_every_scheme(name, d_model):
    model = built(name, d_model=d_model)
    T = 2 * L  # past the train length too
    idx = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    x = first_layer_input(model, idx).double()
    tok = model.tok.weight.detach().double()[idx]  # (B, T, D)
    pos = absolute_positions(name, model, T, d_model)
    scale = ((x - pos) * tok).sum() / (tok * tok).sum()  # the least-squares scale of the token part
    assert scale.item() == pytest.approx(math.sqrt(d_model), rel=1e-5), f"{name}: token embeddings scaled by {scale:.4f}"
    assert_close(x, tok * math.sqrt(d_model) + pos, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ALL)
def test_scale_embeddings_false_leaves_every_scheme_unscaled(name):
    model = built(name, scale_embeddings=False)
    idx = torch.randint(0, VOCAB, (1, L), generator=torch.Generator().manual_seed(2))
    x = first_layer_input(model, idx).double()
    expected = model.tok.weight.detach().double()[idx] + absolute_positions(name, model, L, 32)
    assert_close(x, expected, rtol=1e-5, atol=1e-5)


def test_the_recipe_is_the_default():
    cfg = config("rope")
    assert cfg["model"]["scale_embeddings"] is True
    assert training_options(OmegaConf.structured(PosbenchConfig(model=OmegaConf.create(cfg["model"])))) == []


@pytest.mark.parametrize("given, expected", [(None, False), (True, True), (False, False)])
def test_the_llama_block_leaves_embeddings_unscaled_unless_told(given, expected):
    """Llama's convention: x = E[idx], no sqrt(D) (transformers' LlamaModel); model.scale_embeddings=true restores it."""
    cfg = config("nope", scale_embeddings=given, block="llama")
    assert cfg["model"]["scale_embeddings"] is expected
    torch.manual_seed(0)
    model = build_model(model_spec(cfg, VOCAB)).eval()
    idx = torch.randint(0, VOCAB, (1, L), generator=torch.Generator().manual_seed(2))
    factor = math.sqrt(32) if expected else 1.0
    assert_close(first_layer_input(model, idx), model.tok.weight.detach()[idx] * factor)
    said = training_options(OmegaConf.structured(PosbenchConfig(model=OmegaConf.create(cfg["model"]))))
    assert ("model.scale_embeddings=True" in said) is (given is True), said  # the first log line names a departure only


@pytest.mark.parametrize("block", ["gpt", "llama"])
def test_initialisation_is_the_blocks_own(block):
    """GPT-2 (Radford et al. 2019, §2.3): the maps into the residual stream start N(0, (0.02/sqrt(2·n_layer))²), the
    others N(0, 0.02²); Llama (transformers' ``initializer_range``): every matrix N(0, 0.02²). Sample standard
    deviations of 10⁴–10⁵ draws, to 5%."""
    n_layer = 8
    torch.manual_seed(0)
    model = build_model(model_spec(config("rope", d_model=128, block=block, n_layer=n_layer), VOCAB))
    residual = 0.02 / math.sqrt(2 * n_layer) if block == "gpt" else 0.02
    for name, p in model.named_parameters():
        if p.dim() == 2:
            into_residual = name.endswith(("attn.proj.weight", "mlp.2.weight", "mlp.down.weight"))
            want = residual if into_residual else 0.02
            assert p.detach().std().item() == pytest.approx(want, rel=0.05), (name, p.std().item(), want)


# ---- the model does not depend on evaluation settings ----------------------------------------------


def _train(data_cache, run_dir, lengths):
    """``posbench train debug=fast scheme=learned eval.lengths=lengths train.threads=1``, trained in this process."""
    record = train_here(data_cache, run_dir, "scheme=learned", f"eval.lengths=[{','.join(map(str, lengths))}]", "train.threads=1")
    assert record["status"] == "complete"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    state = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    results = json.loads((run_dir / "results.json").read_text())
    return metrics, state, results


def test_evaluation_lengths_do_not_change_the_trained_model(data_cache, tmp_path, torch_state):
    m1, s1, r1 = _train(data_cache, tmp_path / "to64", [32, 64])
    m2, s2, r2 = _train(data_cache, tmp_path / "to128", [32, 128])
    assert len(m1) == len(m2) > 0
    assert [m["loss"] for m in m1] == [m["loss"] for m in m2], "the losses depend on eval.lengths"
    assert [m["grad_norm"] for m in m1] == [m["grad_norm"] for m in m2]
    w1, w2 = s1["model"], s2["model"]
    assert sorted(w1) == sorted(w2)
    tables = [k for k in w1 if k.startswith("scheme.")]
    assert tables == ["scheme.table.weight"]
    differ = [k for k in w1 if k not in tables and not torch.equal(w1[k], w2[k])]
    assert not differ, f"weights that depend on eval.lengths: {differ}"
    t1, t2 = w1["scheme.table.weight"], w2["scheme.table.weight"]
    assert torch.equal(t1[:32], t2[:32]), "the trained rows (positions < L) of the table differ"
    # the table's size is the config's, not the longest evaluation length: the whole table is the same
    assert s1["config"]["scheme"]["max_positions"] == s2["config"]["scheme"]["max_positions"] == 16 * 32
    assert t1.shape == t2.shape == (16 * 32, s1["config"]["model"]["d_model"])
    assert torch.equal(t1, t2)
    # and the same model scores the same span the same way at the length both runs evaluated
    at32 = [next(r for r in rec["results"] if r["length"] == 32) for rec in (r1, r2)]
    assert at32[0]["tokens"] == at32[1]["tokens"] and at32[0]["nll"] == at32[1]["nll"]


# ---- weight decay: decided per scheme, never by a scheme parameter's rank ---------------------------------


def _decayed_names(model) -> set[str]:
    from posbench.training.optim import make_optimizer

    opt = make_optimizer(model, OmegaConf.create({"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}), fused=False)
    ids = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("name", ALL)
def test_the_model_decays_its_matrices_and_nothing_else(name):
    model = built(name)
    expected = {n for n, p in model.named_parameters() if not n.startswith("scheme.") and p.dim() >= 2}
    expected |= {"scheme.table.weight"} if name == "learned" else set()  # GPT-2 and nanoGPT decay wpe
    assert _decayed_names(model) == expected


def test_a_scheme_matrix_is_not_decayed_unless_the_scheme_says_so():
    from posbench.model.gpt import GPT
    from posbench.schemes import PositionalScheme

    class Table(PositionalScheme):  # a 2-D learned bias table: rank alone would have it decayed
        def __init__(self, d_model, n_head):
            super().__init__(d_model, n_head)
            self.rel = torch.nn.Parameter(torch.zeros(n_head, 8))

    class DecayedTable(Table):
        weight_decay = True

    for cls, decayed in ((Table, False), (DecayedTable, True)):
        model = GPT(VOCAB, 1, 2, 16, 32, cls(16, 2))
        assert ("scheme.rel" in _decayed_names(model)) is decayed, cls.__name__


def test_scheme_parameters_keep_the_initialisation_their_scheme_gives_them():
    """GPT's init (normal_ for matrices, zeros for names ending in 'bias') must not touch ``scheme.*``."""
    from posbench.model.gpt import GPT
    from posbench.schemes import PositionalScheme

    class Slopes(PositionalScheme):
        def __init__(self, d_model, n_head):
            super().__init__(d_model, n_head)
            self.bias = torch.nn.Parameter(torch.full((n_head,), 0.5))
            self.table_bias = torch.nn.Parameter(torch.full((n_head, 4), 2.0))

    model = GPT(VOCAB, 1, 2, 16, 32, Slopes(16, 2))
    assert torch.equal(model.scheme.bias, torch.full((2,), 0.5))
    assert torch.equal(model.scheme.table_bias, torch.full((2, 4), 2.0))
