"""The Llama block (``model.block=llama``: posbench/model/blocks.py; issue 47 item 1), checked against transformers'
own LlamaForCausalLM and Qwen2ForCausalLM, the independent implementation: the same weights copied across by name
give the same logits in float64 (to 1e-6 of the largest: transformers' rotary tables are float32), with grouped-query
attention, a head width other than D / H, an untied head and biases on q, k and v. And the default block is today's
model, parameter for parameter; every scheme, hybrid pattern, window and sink builds, runs and trains in the new
block; bad sizes are refused in one line.
"""

from __future__ import annotations

import pytest
import torch

from posbench.model.build import build_model
from posbench.schemes import SCHEMES

transformers = pytest.importorskip("transformers")

V, T = 97, 48  # vocabulary; a length past the HF config's max_position_embeddings (32)


def posbench_llama(n_kv_head: int, head_dim: int | None, tie: bool, bias: bool, base: float = 500.0):
    torch.manual_seed(0)
    spec = {"vocab_size": V, "scheme": {"name": "rope", "base": base},
            "model": {"n_layer": 2, "n_head": 4, "d_model": 32, "d_ff": 40, "block": "llama", "n_kv_head": n_kv_head,
                      "head_dim": head_dim, "tie_head": tie, "qkv_bias": bias, "norm_eps": 1e-6,
                      "scale_embeddings": False}}
    model = build_model(spec).double().eval()
    with torch.no_grad():  # gains and biases off their initial 1 and 0, so that a misplaced one shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_twin(model, n_kv_head: int, head_dim: int | None, tie: bool, bias: bool, base: float = 500.0):
    """transformers' model of the same sizes, its weights copied from ``model`` by name (the q, k, v rows split)."""
    dh = head_dim or 32 // 4
    kind = transformers.Qwen2Config if bias else transformers.LlamaConfig
    extra = {} if bias else {"attention_bias": False, "mlp_bias": False, "head_dim": dh}
    config = kind(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=n_kv_head, max_position_embeddings=32, rms_norm_eps=1e-6,
                  rope_theta=base, tie_word_embeddings=tie, attn_implementation="eager", **extra)
    config.rope_parameters = {"rope_type": "default", "rope_theta": base}  # (transformers 5 reads the base here)
    hf = (transformers.Qwen2ForCausalLM if bias else transformers.LlamaForCausalLM)(config).double().eval()
    ours = model.state_dict()
    state = {"model.embed_tokens.weight": ours["tok.weight"], "model.norm.weight": ours["ln_f.weight"],
             "lm_head.weight": ours["head.weight"]}
    for i in range(2):
        p, q = f"blocks.{i}.", f"model.layers.{i}."
        sizes = [4 * dh, n_kv_head * dh, n_kv_head * dh]
        for part in ("weight", "bias") if bias else ("weight",):
            for name, block in zip(("q_proj", "k_proj", "v_proj"), ours[p + "attn.qkv." + part].split(sizes)):
                state[f"{q}self_attn.{name}.{part}"] = block
        state.update({f"{q}self_attn.o_proj.weight": ours[p + "attn.proj.weight"],
                      f"{q}input_layernorm.weight": ours[p + "ln1.weight"],
                      f"{q}post_attention_layernorm.weight": ours[p + "ln2.weight"],
                      f"{q}mlp.gate_proj.weight": ours[p + "mlp.gate.weight"],
                      f"{q}mlp.up_proj.weight": ours[p + "mlp.up.weight"],
                      f"{q}mlp.down_proj.weight": ours[p + "mlp.down.weight"]})
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k or (tie and k == "lm_head.weight") for k in missing), (missing, unexpected)
    return hf


@pytest.mark.parametrize("n_kv_head, head_dim, tie, bias", [(4, None, True, False), (2, None, True, False),
                                                            (1, 12, False, False), (2, None, False, True)])
def test_the_llama_block_gives_transformers_logits(n_kv_head, head_dim, tie, bias):
    model = posbench_llama(n_kv_head, head_dim, tie, bias)
    hf = hf_twin(model, n_kv_head, head_dim, tie, bias)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ours.shape == theirs.shape == (2, T, V)
    # 1e-6, not float64's 1e-15: transformers computes its rotary cos and sin in float32 whatever the model's dtype
    assert (ours - theirs).abs().max() <= 1e-6 * theirs.abs().max(), (ours - theirs).abs().max()


def test_the_default_block_is_gpt_2_s_with_its_parameter_names():
    torch.manual_seed(0)
    model = build_model({"vocab_size": V, "scheme": {"name": "rope"}, "model": {}})
    names = {n for n, _ in model.named_parameters()}
    assert {"blocks.0.ln1.bias", "blocks.0.mlp.0.bias", "blocks.0.mlp.2.weight", "ln_f.bias"} <= names
    assert model.blocks[0].attn.qkv.weight.shape == (3 * 128, 128) and model.head.weight is model.tok.weight
    assert isinstance(model.blocks[0].ln1, torch.nn.LayerNorm) and isinstance(model.blocks[0].mlp[1], torch.nn.GELU)


def test_the_llama_block_has_no_biases_and_starts_as_llama():
    """Llama's initialisation (transformers' ``initializer_range``): the maps into the residual stream start as every
    other matrix, N(0, 0.02²), not GPT-2's 0.02/sqrt(2·n_layer); norm gains one."""
    torch.manual_seed(0)
    model = build_model({"vocab_size": V, "scheme": {"name": "rope"},
                         "model": {"block": "llama", "n_kv_head": 2, "n_layer": 8, "tie_head": False}})
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]
    assert model.head.weight is not model.tok.weight
    block = model.blocks[0]
    assert block.attn.qkv.weight.shape == ((4 + 2 * 2) * 32, 128)
    assert block.mlp.down.weight.std().item() == pytest.approx(0.02, rel=0.05)  # (GPT-2's: 0.02 / sqrt(2 · 8) = 0.005)
    assert block.attn.proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.gate.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert all(torch.equal(n.weight, torch.ones(128)) for n in (block.ln1, block.ln2, model.ln_f))


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_every_scheme_trains_in_the_llama_block_with_grouped_query_attention(scheme):
    options = {"learned": {"max_positions": 64}, "rope": {}, "cope": {"npos": 17}}.get(scheme, {})
    torch.manual_seed(0)
    model = build_model({"vocab_size": V, "scheme": {"name": scheme, **options},
                         "model": {"n_layer": 2, "n_head": 4, "d_model": 32, "d_ff": 48, "block": "llama",
                                   "n_kv_head": 2}})
    ids = torch.randint(0, V, (2, 16))
    loss = model(ids, targets=ids).mean()
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("options", [{"layer_pattern": "LG", "window": 8, "global_scheme": {"name": "nope"}},
                                     {"layer_pattern": "LG", "window": 8, "window_kind": "chunked",
                                      "qk_norm": "rms", "qk_norm_layers": "local"},
                                     {"attn_sink": True, "layer_pattern": "LG", "window": 8},
                                     {"attn_scale": "ssmax"}])
def test_hybrids_windows_sinks_and_temperatures_run_in_the_llama_block(options):
    torch.manual_seed(0)
    model = build_model({"vocab_size": V, "scheme": {"name": "rope"},
                         "model": {"n_layer": 2, "n_head": 4, "d_model": 32, "d_ff": 48, "block": "llama",
                                   "n_kv_head": 1, "head_dim": 12, **options}})
    ids = torch.randint(0, V, (2, 24))
    loss = model(ids, targets=ids).mean()
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("model, message", [({"block": "mamba"}, "block='mamba' is unknown"),
                                            ({"n_kv_head": 3}, "n_kv_head=3 must divide n_head=4")])
def test_bad_blocks_and_heads_are_refused_by_the_model(model, message):
    with pytest.raises(ValueError, match=message):
        build_model({"vocab_size": V, "scheme": {"name": "rope"}, "model": model})
