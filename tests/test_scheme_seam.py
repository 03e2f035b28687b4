"""The scheme seam (docs/design.md §3): a scheme declares its hyperparameters in its own ``Config`` and
nothing else needs to change. A toy scheme defined here, with one option, is registered in ``SCHEMES`` and
then built from a model spec, composed and checked through Hydra, refused when its option is bad or
misspelt, and saved and rebuilt from a checkpoint. Also: format-3 records keep a scheme's own keys only,
older ones are upgraded, and one builder makes every model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from torch.testing import assert_close

from posbench import cli
from posbench.config import schema
from posbench.config.checks import ConfigError
from posbench.config.schema import finalize, to_dict
from posbench.config.upgrade import upgrade
from posbench.evaluation.perplexity import evaluate
from posbench.model import build
from posbench.schemes import SCHEMES, PositionalScheme, build_scheme
from posbench.schemes.absolute import Learned
from posbench.training import checkpoint

VOCAB, H, D, T = 53, 2, 16, 24


class Toy(PositionalScheme):
    """score(i, j) += −gamma · (h + 1) · |i − j|: a bias whose strength is the option ``gamma``."""

    has_bias = True

    @dataclass
    class Config(PositionalScheme.Config):
        """gamma: the bias per head and unit distance; must be in (0, 1]."""

        gamma: float = 0.5

        def resolve(self, seq_len: int, longest: int) -> None:
            if not 0 < self.gamma <= 1:
                raise ValueError(f"gamma={self.gamma}: the toy bias needs 0 < gamma <= 1")

    def score_mod(self, score, h, q_pos, k_pos):
        return score - self.config.gamma * (h + 1) * (q_pos - k_pos).abs()


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(SCHEMES, "toy", Toy)
    cli.register()  # the scheme group now has a toy option
    yield
    monkeypatch.undo()
    cli.register()  # and no longer


def toy_spec(gamma: float) -> dict:
    return {"vocab_size": VOCAB, "model": {"n_layer": 1, "n_head": H, "d_model": D, "d_ff": 2 * D},
            "scheme": {"name": "toy", "gamma": gamma}}


def first_attention(model, idx):
    """(input, output) of the first block's attention layer in a forward pass over ``idx``."""
    seen = []
    handle = model.blocks[0].attn.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    with torch.no_grad():
        model(idx)
    handle.remove()
    return seen[0]


def reference_attention(attn, x, gamma: float) -> torch.Tensor:
    """softmax(q·kᵀ/√Dh − gamma·(h+1)·|i − j|, causal) · v, projected: by loops over heads and positions, float64."""
    B, _, _ = x.shape
    dh = D // H
    w = attn.qkv.weight.detach().double()
    q, k, v = (x.double() @ w[i * D:(i + 1) * D].T for i in range(3))  # 3 × (B, T, D)
    y = torch.zeros(B, T, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            cols = slice(h * dh, (h + 1) * dh)
            for i in range(T):
                scores = [float(q[b, i, cols] @ k[b, j, cols]) / math.sqrt(dh) - gamma * (h + 1) * abs(i - j)
                          for j in range(i + 1)]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                y[b, i, cols] = sum(wt / total * v[b, j, cols] for j, wt in enumerate(weights))
    return y @ attn.proj.weight.detach().double().T


def test_build_model_gives_the_toy_its_option(toy):
    torch.manual_seed(0)
    model = build.build_model(toy_spec(0.25)).eval()
    assert isinstance(model.scheme, Toy) and model.scheme.config.gamma == 0.25
    for p in model.blocks[0].attn.parameters():  # sharper attention than GPT's init: a stronger test
        torch.nn.init.normal_(p, std=0.3)
    idx = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    x, y = first_attention(model, idx)
    assert_close(y.double(), reference_attention(model.blocks[0].attn, x, 0.25), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(y.double(), reference_attention(model.blocks[0].attn, x, 0.5), atol=1e-3), \
        "the output does not depend on gamma"


def test_hydra_composes_the_toy_with_its_option(toy):
    with initialize_config_module(cli.CONFIG_MODULE, version_base="1.3"):
        cfg = compose("train", overrides=["scheme=toy", "scheme.gamma=0.25"])
        assert OmegaConf.to_container(finalize(cfg).scheme) == {"name": "toy", "gamma": 0.25}
        assert OmegaConf.to_container(finalize(compose("train", overrides=["scheme=toy"])).scheme) == {
            "name": "toy", "gamma": 0.5}
        with pytest.raises(ConfigError, match=r"^scheme\.gamma=2\.0: .*0 < gamma <= 1"):
            finalize(compose("train", overrides=["scheme=toy", "scheme.gamma=2"]))
        with pytest.raises(ConfigError, match=r"^scheme\.gama=0\.25: .*Toy.*gamma"):
            finalize(compose("train", overrides=["scheme=toy", "+scheme.gama=0.25"]))
        with pytest.raises(Exception, match="scheme.gama"):  # without "+": Hydra refuses it
            compose("train", overrides=["scheme=toy", "scheme.gama=0.25"])


@pytest.mark.parametrize("overrides, message", [
    (["scheme=toy", "scheme.gamma=2"], "scheme.gamma=2.0: the toy bias needs 0 < gamma <= 1"),
    (["scheme=toy", "scheme.gama=0.25"], "scheme.gama is not an option of the toy scheme; did you mean scheme.gamma? its "
     "options: gamma"),
    (["scheme=rope", "scheme.gamma=0.25"], "scheme.gamma is not an option of the rope scheme; its options: base, scaling, "
     "factor, beta_fast, beta_slow, original_length, yarn_ramp, low_freq_factor, high_freq_factor, rotary_fraction"),
])
def test_the_cli_refuses_a_bad_or_misspelt_option_in_one_line(toy, capsys, overrides, message):
    with pytest.raises(SystemExit) as info:
        cli.preflight(overrides, "train")
    err = capsys.readouterr().err
    assert info.value.code == 2 and err == f"posbench: error: {message}\n", err


def test_a_toy_checkpoint_rebuilds_the_same_model(toy, tmp_path):
    with initialize_config_module(cli.CONFIG_MODULE, version_base="1.3"):
        cfg = to_dict(finalize(compose("train", overrides=["scheme=toy", "scheme.gamma=0.25", "model.n_layer=1"])))
    spec = build.model_spec(cfg, VOCAB)
    assert spec["scheme"] == {"name": "toy", "gamma": 0.25}
    torch.manual_seed(0)
    model = build.build_model(spec).eval()
    checkpoint.save(tmp_path / "checkpoint.pt", model, spec, cfg, {}, step=1)
    state = checkpoint.read(tmp_path / "checkpoint.pt")
    assert state["format"] == 3 and state["spec"] == spec and state["config"]["scheme"] == {"name": "toy", "gamma": 0.25}
    idx = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(idx)
        for rebuilt in (build.model_from(state), build.model_from({**state, "spec": None})):
            assert rebuilt.scheme.config.gamma == 0.25
            assert torch.equal(rebuilt(idx), expected)
        other = build.build_model(spec, {"scheme": {"gamma": 1.0}}).eval()
        other.load_state_dict(state["model"])
        assert not torch.allclose(other(idx), expected), "gamma does not reach the rebuilt model"


# ---- formats ----------------------------------------------------------------------------------------


def test_an_old_scheme_section_keeps_the_scheme_s_own_keys():
    old = {"name": "rope", "base": 10000.0, "max_positions": None}  # formats 1 and 2 recorded both for every scheme
    for fmt in (1, 2):
        assert upgrade({"scheme": old}, fmt)["scheme"] == {
            "name": "rope", "base": 10000.0, "scaling": "none", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_length": None, "yarn_ramp": "reference", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "rotary_fraction": 1.0}
    assert upgrade({"scheme": {"name": "learned", "base": 10000.0, "max_positions": 96}}, 2)["scheme"] == {
        "name": "learned", "max_positions": 96}
    assert upgrade({"scheme": {"name": "alibi", "base": 500.0}}, 2)["scheme"] == {"name": "alibi"}
    assert upgrade({"scheme": {"name": "sinusoidal"}}, 3)["scheme"] == {"name": "sinusoidal", "base": 10000.0}
    assert upgrade({}, 3)["scheme"] == {  # a missing key reads as its default
        "name": "rope", "base": 10000.0, "scaling": "none", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_length": None, "yarn_ramp": "reference", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "rotary_fraction": 1.0}
    with pytest.raises(ConfigError, match="max_positions"):
        upgrade({"scheme": old}, 3)  # format 3 records a scheme's own keys only
    with pytest.raises(ConfigError, match="noscheme"):
        upgrade({"scheme": {"name": "noscheme"}}, 3)


DEFAULTS = {"rope": {"scaling": "none", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,  # a scheme's options that
                     "original_length": None, "yarn_ramp": "reference", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "rotary_fraction": 1.0}}  # old formats never recorded
OWN = {"rope": {"base": 500.0}, "sinusoidal": {"base": 500.0}, "learned": {"max_positions": 40}, "alibi": {}}


def old_state(name: str, fmt: int, tmp_path) -> tuple[dict, torch.nn.Module]:
    """A checkpoint as format ``fmt`` wrote it (no spec; base and max_positions for every scheme; format 1
    without model.scale_embeddings), of a model made here with the scheme's own options ``OWN``, and that model."""
    model_cfg = {"name": "t", "n_layer": 1, "n_head": H, "d_model": D, "d_ff": 2 * D, "dropout": 0.0}
    scale = name == "sinusoidal" if fmt == 1 else True  # format 1 scaled embeddings for sinusoidal only
    torch.manual_seed(0)
    model = build.build_model({"vocab_size": VOCAB, "model": {**model_cfg, "scale_embeddings": scale},
                                    "scheme": {"name": name, **OWN[name]}}).eval()
    recorded = {"scheme": {"name": name, "base": 10000.0, "max_positions": None, **OWN[name]},
                "model": model_cfg if fmt == 1 else {**model_cfg, "scale_embeddings": scale}, "train": {"seq_len": 8}}
    path = tmp_path / f"{name}-{fmt}.pt"
    torch.save({"format": fmt, "model": model.state_dict(), "config": recorded, "vocab_size": VOCAB, "tokenizer": {},
                "step": 1}, path)
    return checkpoint.read(path), model


@pytest.mark.parametrize("fmt", [1, 2])
@pytest.mark.parametrize("name", ["rope", "learned", "sinusoidal", "alibi"])
def test_an_old_checkpoint_loads_and_scores_the_same(name, fmt, tmp_path):
    state, model = old_state(name, fmt, tmp_path)
    rebuilt = build.model_from(state)
    tokens = np.random.default_rng(0).integers(0, VOCAB, 200).astype(np.uint16)
    expected = evaluate(model, tokens, [8, 16], "nonoverlapping")
    got = evaluate(rebuilt, tokens, [8, 16], "nonoverlapping")
    assert [r["ppl"] for r in got] == [r["ppl"] for r in expected]
    assert state["config"]["scheme"] == {"name": name, **DEFAULTS.get(name, {}), **OWN[name]}
    if name == "learned":
        assert rebuilt.scheme.table.weight.shape[0] == 40  # the recorded table size, not 16·L


def test_a_yarn_checkpoint_from_before_the_ramp_option_rebuilds_the_paper_ramp(tmp_path):
    """A checkpoint of a model trained with YaRN before scheme.yarn_ramp existed records no ramp: it was the
    paper's, and the rebuilt model computes what was trained (the default, the reference ramp, would not)."""
    scheme = {"name": "rope", "base": 10000.0, "scaling": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
              "original_length": 8}
    spec = {"vocab_size": VOCAB, "model": {"n_layer": 1, "n_head": H, "d_model": D, "d_ff": 2 * D}, "scheme": scheme}
    torch.manual_seed(0)
    trained = build.build_model(spec, {"scheme": {"yarn_ramp": "paper"}}).eval()
    torch.save({"format": 3, "model": trained.state_dict(), "spec": spec, "config": {"scheme": scheme, "train": {"seq_len": 8}},
                "vocab_size": VOCAB, "tokenizer": {}, "step": 1}, tmp_path / "old.pt")
    state = checkpoint.read(tmp_path / "old.pt")
    assert state["spec"]["scheme"]["yarn_ramp"] == state["config"]["scheme"]["yarn_ramp"] == "paper"
    idx = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(build.model_from(state)(idx), trained(idx))
        default = build.build_model(spec).eval()  # the same spec read as today's: the reference ramp
        default.load_state_dict(state["model"])
        assert not torch.equal(default(idx), trained(idx))


def test_a_record_from_before_attn_dropout_reads_its_dropout(tmp_path):
    """Before model.attn_dropout, model.dropout dropped the attention probabilities too: a checkpoint, training state
    or results record without the key reads attn_dropout = dropout, so the rebuilt model, and a resumed run, is the
    one trained (resuming it with today's default, 0, is a changed key); a record with the key keeps its own."""
    from posbench.config.upgrade import model_section
    from posbench.training.states import changed_keys

    model = {"n_layer": 1, "n_head": H, "d_model": D, "d_ff": 2 * D, "dropout": 0.1}
    config = {"scheme": {"name": "alibi"}, "model": model, "train": {"seq_len": 8}}
    for fmt in (None, 1, 3, 4):
        assert upgrade(config, fmt)["model"]["attn_dropout"] == 0.1
    assert upgrade({**config, "model": {**model, "attn_dropout": 0.0}})["model"]["attn_dropout"] == 0.0
    assert upgrade({"scheme": {"name": "alibi"}})["model"]["attn_dropout"] == 0.0  # neither key: the defaults
    assert model_section({"dropout": 0.1}) == {**model_section({}), "dropout": 0.1, "attn_dropout": 0.1}
    assert model_section({"dropout": 0.1, "attn_dropout": 0.0})["attn_dropout"] == 0.0
    torch.manual_seed(0)
    spec = {"vocab_size": VOCAB, "model": model, "scheme": {"name": "alibi"}}  # as written before the option
    trained = build.build_model(spec, {"model": {"attn_dropout": 0.1}})
    torch.save({"format": 3, "model": trained.state_dict(), "spec": spec, "config": config, "vocab_size": VOCAB,
                "tokenizer": {}, "step": 1}, tmp_path / "old.pt")
    state = checkpoint.read(tmp_path / "old.pt")
    assert state["spec"]["model"]["attn_dropout"] == state["config"]["model"]["attn_dropout"] == 0.1
    assert build.model_from(state).attn_dropout == 0.1
    today = upgrade({**config, "model": {**model, "attn_dropout": 0.0}})
    assert changed_keys(state["config"], today) == ["model.attn_dropout"]


# ---- one builder and its spec ------------------------------------------------------------------------


def test_model_spec_is_exact_and_resolved():
    cfg = {"scheme": {"name": "learned"}, "model": {"name": "tiny", "n_layer": 2}, "train": {"seq_len": 20}}
    assert build.model_spec(cfg, VOCAB) == {
        "vocab_size": VOCAB, "scheme": {"name": "learned", "max_positions": 320},  # 16·L
        "model": {"n_layer": 2, "n_head": 4, "d_model": 128, "d_ff": 512, "dropout": 0.0, "attn_dropout": 0.0,
                  "scale_embeddings": True, "attn_scale": "none", "scale_length": None, "scale_beta": 0.1,
                  "scale_layers": "all", "layer_pattern": "G",
                  "global_scheme": None, "window": None, "window_kind": "sliding", "qk_norm": "none",
                  "qk_norm_layers": "all", "qk_norm_weight": True, "attn_sink": False, "block": "gpt",
                  "n_kv_head": None, "head_dim": None, "tie_head": True, "qkv_bias": False, "norm_eps": 1e-5}}


def test_build_model_overrides_and_defaults():
    spec = {"vocab_size": VOCAB, "model": {"n_layer": 3, "n_head": H, "d_model": D}, "scheme": {"name": "rope", "base": 500.0}}
    rope = build.build_model(spec)
    assert len(rope.blocks) == 3 and rope.blocks[0].mlp[0].out_features == 512  # d_ff: ModelConfig's default
    assert_close(rope.scheme.inv_freq, 500.0 ** (-torch.arange(0, D // H, 2, dtype=torch.float64) / (D // H)))
    alibi = build.build_model(spec, {"scheme": {"name": "alibi"}, "model": {"n_layer": 2}})  # base dropped
    assert type(alibi.scheme).__name__ == "ALiBi" and len(alibi.blocks) == 2
    assert build.build_model(spec, {"scheme": {"base": 20.0}}).scheme.config.base == 20.0
    with pytest.raises(ValueError, match="max_positions"):
        build.build_model(spec, {"scheme": {"max_positions": 64}})  # not a rope option
    with pytest.raises(ValueError, match="n_layers"):
        build.build_model(spec, {"model": {"n_layers": 2}})


def test_build_scheme_refuses_an_option_the_scheme_lacks():
    with pytest.raises(ValueError) as info:
        build_scheme("rope", D, H, max_positions=64)
    assert str(info.value).startswith("max_positions=64") and "base" in str(info.value)
    with pytest.raises(ValueError, match="none"):
        build_scheme("alibi", D, H, base=500.0)
    assert build_scheme("sinusoidal", D, H, base=500.0).config.base == 500.0


def test_learned_resolve():
    c = Learned.Config()
    c.resolve(32, 512)
    assert c.max_positions == 16 * 32
    c = Learned.Config(max_positions=600)
    c.resolve(32, 600)
    assert c.max_positions == 600  # a given size is kept
    with pytest.raises(ValueError) as info:
        Learned.Config(max_positions=64).resolve(32, 128)
    assert str(info.value).startswith("max_positions=64: a learned table of 64 rows cannot serve length 128")
    with pytest.raises(ValueError, match="^max_positions=512: .* length 1024"):
        Learned.Config().resolve(32, 1024)  # the default 16·L is too small for 32L


def test_scheme_schemas_pickle():
    """A composed config holds the scheme's schema class; joblib and SLURM sweeps pickle it."""
    import pickle

    for name in ("rope", "learned"):
        made = schema.scheme_schema(name)
        node = OmegaConf.structured(made)
        assert pickle.loads(pickle.dumps(made)) is made
        assert OmegaConf.to_container(pickle.loads(pickle.dumps(node))) == OmegaConf.to_container(node)
