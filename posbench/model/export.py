"""A posbench model as a Hugging Face one: the config of the transformers family that computes the same model, and the
state dict in that family's names, so that any HF tool reads what posbench trains (``posbench export``).

    config = hf_config(spec, train_length=128, eos_token_id=0)     # a transformers config; raises ExportError
    hf = transformers.AutoModelForCausalLM.from_config(config)
    hf.load_state_dict(hf_state(model.state_dict(), spec), strict=False)   # (a tied head has no key of its own)

The family is the one whose block holds the model's options: the Llama block with RoPE is ``llama``; with a window over
every layer ``mistral``; with q/k/v biases ``qwen2``; with QK-norm ``qwen3``; with NoPE layers among RoPE ones
``smollm3``. The mapping is the inverse of posbench/model/pretrained.py's reading, and is checked by it: the config
read back (``pretrained.spec_of``) must give the model's own spec, so an option no family holds (ALiBi, a temperature,
an attention sink, √D on the embeddings, the GPT block) is refused in one line, never exported as another model.
"""

from __future__ import annotations

import torch

from posbench.attention.windows import expand_pattern
from posbench.config.model_checks import global_name
from posbench.model import build
from posbench.model.pretrained import LAYER_NAMES, ROPE_TYPES, PretrainedError, spec_of

TRAINING_ONLY = ("dropout", "attn_dropout")  # model options that do not change the function a model computes


class ExportError(ValueError):
    """A model no transformers family computes; the message is one line that says why."""


def hf_config(spec: dict, train_length: int, eos_token_id: int | None = None):
    """The transformers config of the model ``spec`` (posbench/model/build.py) trained at ``train_length`` tokens
    (``max_position_embeddings``; a scaled RoPE's original length is ``original_max_position_embeddings``).

    Raises ExportError: the GPT block, a scheme other than RoPE (NoPE only as some layers of a RoPE model), a RoPE
    scaling outside ``pretrained.ROPE_TYPES``, or any option the family's config cannot hold (the config read back by
    ``pretrained.spec_of`` differs from ``spec``: the message names the options)."""
    import transformers  # (the hf extra)

    m, s = spec["model"], spec["scheme"]
    if m["block"] != "llama":
        raise ExportError(f"model.block={m['block']}: transformers has no GPT-2 block with posbench's positions; "
                          "export takes Llama-block runs (model.block=llama)")
    if s["name"] != "rope":
        raise ExportError(f"scheme={s['name']}: the families transformers runs position tokens by RoPE (and NoPE "
                          "layers beside RoPE ones, SmolLM3's); export takes scheme=rope runs")
    heads = m["n_head"]
    nope = global_name(m) == ["nope"]
    family = "qwen3" if m["qk_norm"] == "rms" else "qwen2" if m["qkv_bias"] else "smollm3" if nope else \
        "mistral" if m["window"] else "llama"
    sizes = dict(vocab_size=spec["vocab_size"], hidden_size=m["d_model"], intermediate_size=m["d_ff"],
                 num_hidden_layers=m["n_layer"], num_attention_heads=heads, num_key_value_heads=m["n_kv_head"] or heads,
                 head_dim=m["head_dim"] or m["d_model"] // heads, max_position_embeddings=train_length,
                 rms_norm_eps=m["norm_eps"], tie_word_embeddings=m["tie_head"], hidden_act="silu",
                 rope_parameters=_rope_parameters(s), bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None)
    family_options = {"llama": dict(attention_bias=False, mlp_bias=False), "qwen3": dict(attention_bias=False),
                      "mistral": dict(sliding_window=m["window"]), "qwen2": dict(use_sliding_window=False),
                      "smollm3": dict(no_rope_layers=_rope_layers(m), use_sliding_window=False)}[family]
    config = transformers.AutoConfig.for_model(family, **sizes, **family_options)
    try:
        back = spec_of(config)
    except PretrainedError as e:
        raise ExportError(f"the model has no {family} form: {e}") from None
    differs = _differences(_full(spec, train_length), _full(back, train_length))
    if differs:
        raise ExportError(f"{', '.join(differs)}: a {family} config cannot hold {'it' if len(differs) == 1 else 'them'} "
                          f"(transformers would compute another model); export takes what a family holds")
    return config


def hf_state(state: dict, spec: dict) -> dict:
    """posbench's state dict of the model ``spec`` in the names of its transformers family (:func:`hf_config`): ``qkv``
    split into the q, k and v projections (rows q, then k, then v), the rest renamed one to one; a tied head has no
    ``lm_head.weight``. Raises ExportError for a weight no family holds (a learned scheme's)."""
    m = spec["model"]
    heads, kv = m["n_head"], m["n_kv_head"] or m["n_head"]
    width = m["head_dim"] or m["d_model"] // heads
    out = {"model.embed_tokens.weight": state["tok.weight"], "model.norm.weight": state["ln_f.weight"]}
    if not m["tie_head"]:
        out["lm_head.weight"] = state["head.weight"]
    used = {"tok.weight", "ln_f.weight", "head.weight"}
    for i in range(m["n_layer"]):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        for part in ("weight", "bias") if m["qkv_bias"] else ("weight",):
            q, k, v = state[f"{ours}attn.qkv.{part}"].split([heads * width, kv * width, kv * width])
            out.update({f"{hf}self_attn.{p}_proj.{part}": t.contiguous() for p, t in zip("qkv", (q, k, v))})
            used.add(f"{ours}attn.qkv.{part}")
        for theirs, mine in LAYER_NAMES.items():
            if f"{ours}{mine}.weight" in state:
                out[f"{hf}{theirs}.weight"] = state[f"{ours}{mine}.weight"]
                used.add(f"{ours}{mine}.weight")
    left = sorted(set(state) - used)
    if left:
        raise ExportError(f"weights no transformers family holds: {', '.join(left[:3])}{' …' if len(left) > 3 else ''}")
    return out


def _rope_parameters(scheme: dict) -> dict:
    """transformers' ``rope_parameters`` of posbench's RoPE options; raises ExportError for a scaling it lacks."""
    kinds = {ours: theirs for theirs, ours in ROPE_TYPES.items()}
    if scheme["scaling"] not in kinds:
        raise ExportError(f"scheme.scaling={scheme['scaling']}: transformers' RoPE types are "
                          f"{', '.join(ROPE_TYPES)} (posbench's {', '.join(kinds)})")
    params = {"rope_type": kinds[scheme["scaling"]], "rope_theta": float(scheme["base"])}
    if params["rope_type"] != "default":
        params.update(factor=float(scheme["factor"]), original_max_position_embeddings=scheme["original_length"])
    if params["rope_type"] == "yarn":
        params.update(beta_fast=float(scheme["beta_fast"]), beta_slow=float(scheme["beta_slow"]))
    if params["rope_type"] == "llama3":
        params.update(low_freq_factor=float(scheme["low_freq_factor"]), high_freq_factor=float(scheme["high_freq_factor"]))
    return params


def _rope_layers(m: dict) -> list[int]:
    """SmolLM3's ``no_rope_layers`` (1: the layer turns q and k; 0: NoPE) of the layer pattern (L: RoPE, G: NoPE)."""
    return [int(kind == "L") for kind in expand_pattern(m["layer_pattern"], m["n_layer"])]


def _full(spec: dict, train_length: int) -> dict:
    """``spec`` with every option at its value (``build.model_spec``), grouped heads and head width explicit, a
    global scheme given by name as ``{"name": …}``, and the training-only options dropped."""
    full = build.model_spec({"model": spec["model"], "scheme": spec["scheme"], "train": {"seq_len": train_length}},
                            spec["vocab_size"])
    m = full["model"]
    m["n_kv_head"] = m["n_kv_head"] or m["n_head"]
    m["head_dim"] = m["head_dim"] or m["d_model"] // m["n_head"]
    if isinstance(m["global_scheme"], str):
        m["global_scheme"] = {"name": m["global_scheme"]}
    for key in TRAINING_ONLY:
        m.pop(key)
    return full


def _differences(ours: dict, theirs: dict) -> list[str]:
    """``section.key=value`` of each option of ``ours`` that ``theirs`` holds otherwise."""
    return [f"{section}.{k}={v!r}" for section in ("model", "scheme") for k, v in ours[section].items()
            if theirs[section].get(k) != v] + ([f"vocab_size={ours['vocab_size']}"]
                                                if ours["vocab_size"] != theirs["vocab_size"] else [])


def to_hf(model_state: dict, spec: dict, train_length: int, eos_token_id: int | None = None):
    """The transformers model (float32, eval mode) that computes the posbench model ``spec`` with the weights
    ``model_state``. Raises ExportError as :func:`hf_config` and :func:`hf_state`."""
    import transformers  # (the hf extra)

    config = hf_config(spec, train_length, eos_token_id)
    weights = hf_state(model_state, spec)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if spec["model"]["tie_head"] else set()):
        raise ExportError(f"the {config.model_type} model's weights do not match posbench's: missing {missing}, "
                          f"unexpected {unexpected}")
    if spec["model"]["tie_head"]:
        hf.tie_weights()
    return hf.eval()
