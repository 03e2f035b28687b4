"""``posbench export run=… out=…`` (posbench/jobs/export_job.py, posbench/model/export.py; issue 48): a Llama-block run
written as a Hugging Face folder that transformers' own ``from_pretrained`` loads to posbench's logits (float32, on the
same ids past the run's L), for RoPE, NoPE layers (SmolLM3's form), a window over every layer (Mistral's), QK-norm
(Qwen 3's) and q/k/v biases (Qwen 2's); its tokenizer spells text as the run's; a model no family holds is refused in
one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import kept_torch_state, ok, refused, snapshot, train_here  # noqa: E402
from posbench.model import build  # noqa: E402
from posbench.training import checkpoint  # noqa: E402

LLAMA = ("model.block=llama", "model.n_kv_head=2", "model.tie_head=false", "scheme=rope")  # (no √D: the block's own)
L = 32  # debug=fast's train length


@pytest.fixture(scope="module")
def trained(data_cache, tmp_path_factory) -> Path:
    """A Llama-block RoPE run, trained a few steps (debug=fast) at L = 32."""
    run = tmp_path_factory.mktemp("runs") / "rope"
    with kept_torch_state():
        train_here(data_cache, run, *LLAMA, "train.steps=3", "eval.lengths=[64]", "eval.max_tokens=64")
    return run


def variant(trained: Path, folder: Path, **model) -> Path:
    """A run folder whose checkpoint is the trained run's with the model options ``model`` changed and weights drawn
    at random by posbench's own initialisation (the logits' parity needs no training)."""
    state = checkpoint.read(trained / checkpoint.NAME)
    spec = {**state["spec"], "model": {**state["spec"]["model"], **model}}
    torch.manual_seed(1)
    net = build.build_model(spec)
    folder.mkdir()
    checkpoint.save(folder / checkpoint.NAME, net, spec, state["config"], state["tokenizer"], state["step"])
    return folder


def logits_agree(run: Path, out: Path) -> str:
    """Check that transformers' model read from ``out`` gives the logits of posbench's model of ``run`` (float32,
    ids 0 … 3L−1 drawn at random, 3L past the run's L); return its model_type."""
    model = build.model_from(checkpoint.read(run / checkpoint.NAME)).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 3 * L), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max(), (ours - theirs).abs().max().item()
    return hf.config.model_type


def test_an_exported_run_is_read_by_transformers_as_posbench_computes_it(trained, run_cli, tmp_path):
    proc = ok(run_cli("export", f"run={trained}", f"out={tmp_path / 'hf'}"))
    assert f"exported: {tmp_path / 'hf'}" in proc.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    assert logits_agree(trained, tmp_path / "hf") == "llama"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["max_position_embeddings"] == L and config["num_key_value_heads"] == 2
    state = checkpoint.read(trained / checkpoint.NAME)
    from tokenizers import Tokenizer

    text = "Shall I compare thee to a summer's day?"
    ours = Tokenizer.from_file(state["tokenizer"]["path"]).encode(text).ids
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"] == ours


@pytest.mark.parametrize("model, family", [
    ({"layer_pattern": "LG", "global_scheme": {"name": "nope"}}, "smollm3"),
    ({"layer_pattern": "L", "window": 16}, "mistral"),
    ({"qk_norm": "rms"}, "qwen3"),
    ({"qkv_bias": True}, "qwen2"),
    ({"tie_head": True}, "llama"),
], ids=["nope-layers", "window", "qk-norm", "qkv-bias", "tied"])
def test_each_family_gives_posbench_logits(trained, tmp_path, model, family, torch_state):
    from posbench.jobs import export_job

    run = variant(trained, tmp_path / "run", **model)
    export_job.export(str(run), str(tmp_path / "hf"))
    assert logits_agree(run, tmp_path / "hf") == family


REFUSALS = [  # (model options of the variant, a part of the one line)
    ({"block": "gpt", "n_kv_head": None}, "model.block=gpt: transformers has no GPT-2 block"),
    ({"scale_embeddings": True}, "model.scale_embeddings=True: a llama config cannot hold it"),
    ({"attn_scale": "log_n", "scale_length": 64}, "model.attn_scale='log_n'"),
    ({"attn_sink": True}, "model.attn_sink=True"),
    ({"layer_pattern": "LG", "window": 16}, "model.layer_pattern='LG'"),
]


@pytest.mark.parametrize("model, message", REFUSALS, ids=[next(iter(m)) for m, _ in REFUSALS])
def test_a_model_no_family_holds_gets_one_line_and_nothing_written(trained, posbench_here, model, message):
    here = Path.cwd()
    run = variant(trained, here / "run", **model)
    before = snapshot(here)
    said = refused(posbench_here("export", f"run={run}", f"out={here / 'hf'}"), here, before)
    assert message in said, said


def test_bad_arguments_get_one_line(trained, posbench_here, tmp_path):
    here = Path.cwd()
    (here / "taken").mkdir()
    before = snapshot(here)
    for args, message in [((f"run={trained}",), "posbench export takes run=<run folder> out=<a new folder>"),
                          ((f"run={trained}", "out=hf", "steps=3"), "steps=3: posbench export takes"),
                          ((f"run={trained}", "out=taken"), "out=taken: it exists"),
                          ((f"run={tmp_path}", "out=hf"), "no checkpoint at")]:
        assert message in refused(posbench_here("export", *args), here, before)


def test_a_scheme_no_family_holds_is_refused(data_cache, tmp_path, torch_state):
    from posbench.config.checks import ConfigError
    from posbench.jobs import export_job

    run = tmp_path / "alibi"
    train_here(data_cache, run, *LLAMA[:-1], "scheme=alibi", "train.steps=1", "eval.lengths=[64]", "eval.max_tokens=64")
    with pytest.raises(ConfigError, match="scheme=alibi: the families transformers runs position tokens by RoPE"):
        export_job.export(str(run), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
