"""FIRE as its reference code builds it (mcleish7/arithmetic, ``cramming/architectures/embeddings.py``): one FIRE per
attention layer (``scheme.per_layer=true``, the default) with the threshold starting at 512; ``per_layer=false``
shares one FIRE across layers, posbench's earlier model.

The per-layer model is checked against a hand-built reference: a float64 GPT (tests/naive_gpt.py) whose layer l adds
the FIRE bias of layer l's own parameters, written from the paper's formula (tests/helpers.py ``paper_bias``).
Also: one parameter set per layer, drawn from the scheme's own random stream (every other weight as a NoPE model's),
checkpoint round trips, records from before ``per_layer`` existed read as shared, a fine-tune copies every layer's
FIRE, and the command line's defaults.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from helpers import paper_bias, run_into
from naive_gpt import naive_logits
from posbench.config.upgrade import scheme_section
from posbench.model import build
from posbench.schemes import SCHEMES
from posbench.training import checkpoint

VOCAB, H, D, LAYERS, L = 61, 4, 32, 3, 16  # H = 4: tests/test_relative.py's heads


def spec_of(**options) -> dict:
    return {"vocab_size": VOCAB, "model": {"n_layer": LAYERS, "n_head": H, "d_model": D, "d_ff": 2 * D},
            "scheme": {"name": "fire", "threshold": L, **options}}


def built(seed: int = 3, **options):
    torch.manual_seed(seed)
    return build.build_model(spec_of(**options))


def test_per_layer_holds_one_parameter_set_per_layer():
    model = built()
    assert isinstance(model.scheme, torch.nn.ModuleList) and len(model.scheme) == LAYERS
    one = SCHEMES["fire"](D, H, SCHEMES["fire"].Config(threshold=L))
    per_layer = sum(p.numel() for p in one.parameters())
    keys = [k for k in model.state_dict() if k.startswith("scheme.")]
    assert sorted({k.split(".")[1] for k in keys}) == [str(i) for i in range(LAYERS)]
    assert sum(p.numel() for n, p in model.named_parameters() if n.startswith("scheme.")) == LAYERS * per_layer
    weights = [s.mlp[0].weight for s in model.scheme]
    assert all(not torch.equal(weights[0], w) for w in weights[1:])  # each layer drew its own MLP
    shared = built(per_layer=False)
    assert not isinstance(shared.scheme, torch.nn.ModuleList)
    assert sorted(k for k in shared.state_dict() if k.startswith("scheme.")) == sorted(
        "scheme." + k for k in one.state_dict())


@pytest.mark.parametrize("T", [L, 4 * L])
def test_each_layer_adds_its_own_fire_bias(T):
    """The model against the hand-built reference, each layer's FIRE moved away from its initial c and threshold."""
    model = built().double()
    with torch.no_grad():
        for i, s in enumerate(model.scheme):
            s.c.fill_(0.05 * (i + 1))
            s.multiplier.fill_(0.5 + 0.25 * i)
        for block in model.blocks:  # content logits of order 1, so the bias is not all that decides
            block.attn.qkv.weight.mul_(10)
    idx = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(T))
    expected = naive_logits(model, idx[0], bias=lambda layer, pos: paper_bias("fire", model.scheme[layer], pos))
    with torch.enable_grad():  # the dense kernel, CPU training's
        got = model(idx)[0]
    assert_close(got, expected, atol=1e-9, rtol=1e-9)
    with torch.no_grad():  # FlexAttention, compiled, as CPU evaluation runs a bias that cannot fold
        assert_close(model.float()(idx)[0].double(), expected, atol=2e-4, rtol=1e-4)
    model.double()
    only_first = naive_logits(model, idx[0], bias=lambda layer, pos: paper_bias("fire", model.scheme[0], pos))
    assert (got - only_first).abs().max() > 1e-3  # the layers' biases differ: a shared one would not pass


def test_gradients_reach_every_layers_fire():
    model = built()
    idx = torch.randint(0, VOCAB, (2, 2 * L))
    model(idx, targets=idx).mean().backward()
    for s in model.scheme:
        assert all(p.grad is not None and p.grad.abs().max() > 0 for p in s.parameters())


def test_per_layer_fire_draws_from_the_schemes_own_stream():
    """Every weight outside the scheme is a NoPE model's after the same seed: a comparison differs in positions only."""
    fire, shared = built(seed=11).state_dict(), built(seed=11, per_layer=False).state_dict()
    torch.manual_seed(11)
    nope = build.build_model({**spec_of(), "scheme": {"name": "nope"}}).state_dict()
    for k, v in nope.items():
        assert torch.equal(fire[k], v) and torch.equal(shared[k], v), k
    assert torch.equal(fire["scheme.0.mlp.0.weight"], shared["scheme.mlp.0.weight"])  # layer 0 drew first


def test_defaults_are_the_reference_code_and_null_threshold_is_the_train_length():
    config = SCHEMES["fire"].Config()
    assert (config.threshold, config.per_layer) == (512, True)
    config.resolve(128, 2048)
    assert config.threshold == 512  # no longer derived from L
    earlier = SCHEMES["fire"].Config(threshold=None, per_layer=False)
    earlier.resolve(128, 2048)
    assert earlier.threshold == 128
    with pytest.raises(ValueError, match=r"^per_layer='yes'"):
        SCHEMES["fire"].Config(per_layer="yes").check()


@pytest.mark.parametrize("per_layer", [True, False])
def test_checkpoint_round_trip(per_layer, tmp_path):
    model = built(per_layer=per_layer)
    spec = spec_of(per_layer=per_layer)
    checkpoint.save(tmp_path / "c.pt", model, spec, {"scheme": spec["scheme"]}, {}, step=1)
    again = build.model_from(checkpoint.read(tmp_path / "c.pt"))
    idx = torch.randint(0, VOCAB, (1, 3 * L))
    with torch.no_grad():
        assert torch.equal(again(idx), model.eval()(idx))


def test_a_record_from_before_per_layer_reads_as_shared():
    recorded = {"name": "fire", "mlp_width": 32, "init_c": 0.1, "threshold": 128}  # what a run recorded until now
    assert scheme_section(recorded, 3)["per_layer"] is False  # a checkpoint's
    assert scheme_section(recorded, 4)["per_layer"] is False  # a results record's
    assert "per_layer" not in scheme_section(recorded)  # a partial config of today's: the default
    assert scheme_section({**recorded, "per_layer": True}, 3)["per_layer"] is True


def test_command_line_default_and_a_fine_tune_copy_every_layer(run_cli, data_cache, tmp_path):
    """Runs of one step, evaluated at L alone on 64 tokens: what is checked is their configs and weights (FIRE's
    evaluation on a CPU compiles FlexAttention, once per length)."""
    short = ["eval.lengths=[32]", "eval.max_tokens=64"]
    parent, child = tmp_path / "parent", tmp_path / "child"
    proc = run_into(run_cli, data_cache, parent, "scheme=fire", "train.steps=1", *short)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((parent / "results.json").read_text())["config"]
    assert (config["scheme"]["per_layer"], config["scheme"]["threshold"]) == (True, 512)
    proc = run_into(run_cli, data_cache, child, "scheme=fire", f"init_from={parent}", "train.steps=0", *short)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = torch.load(parent / "checkpoint.pt", weights_only=True)["model"]
    mine = torch.load(child / "checkpoint.pt", weights_only=True)["model"]
    layers = {k for k in theirs if k.startswith("scheme.")}
    assert {k.split(".")[1] for k in layers} == {str(i) for i in range(4)}  # model=tiny: 4 layers, a FIRE each
    assert all(torch.equal(theirs[k], mine[k]) for k in theirs)
    shared = tmp_path / "shared"
    proc = run_into(run_cli, data_cache, shared, "scheme=fire", "scheme.per_layer=false", "scheme.threshold=null",
                    "train.steps=1", *short)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((shared / "results.json").read_text())["config"]
    assert (config["scheme"]["per_layer"], config["scheme"]["threshold"]) == (False, config["train"]["seq_len"])
