"""One builder for every model: a model spec → the GPT it describes (docs/design.md §2).

A model spec is a plain dict, ``{"vocab_size": int, "model": {...}, "scheme": {"name": ..., **options}}``: everything
:func:`build_model` needs, nothing else. A run's job makes it once from the run's finished config (:func:`spec`);
checkpoints record it, and ``posbench eval`` rebuilds the trained model from it, with overrides (a RoPE scaling).

    model = build_model(spec)                                             # as trained
    scaled = build_model(spec, {"scheme": {"scaling": "yarn", "factor": 4.0, "original_length": 128}})
"""

from __future__ import annotations

import dataclasses

import torch

from posbench.attention.windows import expand_pattern
from posbench.config.schema import DEFAULT_SCHEME, ModelConfig
from posbench.config.upgrade import model_section, upgrade
from posbench.model.gpt import GPT
from posbench.schemes import SCHEMES

MODEL_KEYS = [f.name for f in dataclasses.fields(ModelConfig) if f.name != "name"]  # what a spec's "model" holds


def spec(config: dict, vocab_size: int) -> dict:
    """The spec of a run's finished config (``posbench.config.schema.finalize``'s, as a plain dict): its model keys but
    ``name`` (a preset's label, not part of the model) and its scheme section, whose options are resolved."""
    return {"vocab_size": vocab_size, "model": {k: config["model"][k] for k in MODEL_KEYS},
            "scheme": dict(config["scheme"])}


def model_spec(config: dict, vocab_size: int) -> dict:
    """The exact spec of the model a recorded config describes (a checkpoint's from before specs were recorded, or
    a partial config): every key it lacks at its default (``posbench.config.upgrade.upgrade``), the scheme's derived
    defaults filled from the config's train length (``Config.fill``: an unset learned ``max_positions`` → 16·L).

    Raises ConfigError (a ValueError) when ``config`` does not fit the schema."""
    config = upgrade(config)
    options = {k: v for k, v in config["scheme"].items() if k != "name"}
    scheme = SCHEMES[config["scheme"]["name"]].make_config(**options)
    scheme.fill(config["train"]["seq_len"])
    return spec({**config, "scheme": {"name": config["scheme"]["name"], **dataclasses.asdict(scheme)}}, vocab_size)


def merged(spec: dict, overrides: dict) -> dict:
    """``overrides`` merged over ``spec`` key by key (nested dicts recursively); a new ``scheme.name`` drops the
    old scheme's options."""
    out = dict(spec)
    for key, value in overrides.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            if key == "scheme" and value.get("name", old.get("name")) != old.get("name", DEFAULT_SCHEME):
                old = {}
            value = merged(old, value)
        out[key] = value
    return out


def build_model(spec: dict, overrides: dict | None = None) -> GPT:
    """The GPT a model spec describes, with ``overrides`` (a nested dict, e.g. ``{"scheme": {"name": "alibi"},
    "model": {"n_layer": 2}}``) merged over it (:func:`merged`). Keys the spec lacks read as today's defaults:
    ``ModelConfig``'s, ``scheme.name`` :data:`~posbench.config.schema.DEFAULT_SCHEME`, the scheme's ``Config`` defaults
    (neither filled nor checked: give resolved values, e.g. the learned scheme's ``max_positions``).
    ``model.name`` is ignored.

    The scheme's parameters are drawn from their own random stream, seeded by one number taken from torch's
    global generator, so that every other parameter is bit-identical whichever scheme (and whatever table
    size) is built after the same ``torch.manual_seed``: a comparison differs in positions only. A scheme whose
    Config says ``per_layer`` (FIRE's and CoPE's option) is built once per layer that uses it, the first layer's first,
    from that stream; a hybrid model's global scheme (``model.global_scheme``, a section like ``scheme``) is built
    after the local one, from the same stream.

    Raises:
        KeyError: the spec has no ``vocab_size``.
        ValueError: a ``model`` key ModelConfig lacks, an unknown scheme or scheme option, or a value the
            scheme's constructor or the model refuses.
    """
    spec = merged(spec, overrides or {})
    m = model_section(spec.get("model", {}))
    m.pop("name", None)  # a preset's label, not part of the model
    unknown = sorted(set(m) - set(MODEL_KEYS))
    if unknown:
        raise ValueError(f"model.{unknown[0]} is not a model option; the options: {', '.join(MODEL_KEYS)}")
    kinds = expand_pattern(m["layer_pattern"], m["n_layer"])
    g = m["global_scheme"]
    scheme_seed = int(torch.randint(2**62, (), device="cpu"))  # (the CPU generator, also under a meta device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(scheme_seed)
        scheme = _build_scheme(spec.get("scheme"), m, m["n_layer"] if g is None else kinds.count("L"))
        glob = None if g is None else _build_scheme(g, m, kinds.count("G"), "model.global_scheme")
    return GPT(spec["vocab_size"], m["n_layer"], m["n_head"], m["d_model"], m["d_ff"], scheme, dropout=m["dropout"],
               scale_embeddings=m["scale_embeddings"], attn_scale=m["attn_scale"], scale_length=m["scale_length"],
               scale_beta=m["scale_beta"], scale_layers=m["scale_layers"],
               attn_dropout=m["attn_dropout"], global_scheme=glob, layer_pattern=m["layer_pattern"], window=m["window"],
               window_kind=m["window_kind"], qk_norm=m["qk_norm"], qk_norm_layers=m["qk_norm_layers"],
               qk_norm_weight=m["qk_norm_weight"], attn_sink=m["attn_sink"], block=m["block"],
               n_kv_head=m["n_kv_head"], head_dim=m["head_dim"], tie_head=m["tie_head"], qkv_bias=m["qkv_bias"],
               norm_eps=m["norm_eps"])


def _build_scheme(section: dict | None, m: dict, layers: int, what: str = "scheme"):
    """The scheme of a section ``{"name": ..., **options}`` (None: the default scheme's defaults) for ``layers``
    layers: one instance, or, where its Config says ``per_layer`` (FIRE's and CoPE's option), one per layer, drawn in
    turn. Raises ValueError for an unknown scheme or option (``what`` names the section)."""
    options = dict(section or {})
    name = options.pop("name", DEFAULT_SCHEME)
    if name not in SCHEMES:
        where = "" if what == "scheme" else f" in {what}"
        raise ValueError(f"unknown scheme {name!r}{where}; choose one of: {', '.join(sorted(SCHEMES))}")
    config = SCHEMES[name].make_config(**options)
    if getattr(config, "per_layer", False):  # one instance per attention layer, drawn in turn
        return [SCHEMES[name](m["d_model"], m["n_head"], config, m["head_dim"]) for _ in range(layers)]
    return SCHEMES[name](m["d_model"], m["n_head"], config, m["head_dim"])


def model_from(state: dict, device="cpu", overrides: dict | None = None) -> GPT:
    """The trained model a checkpoint dict (``posbench.training.checkpoint.read``) describes, on ``device``, in eval mode:
    built from its ``spec`` (or, for a checkpoint from before specs were recorded, the :func:`model_spec` of its
    config), with ``overrides`` merged over it as :func:`build_model` does.

    Raises RuntimeError when the weights do not fit the model (``load_state_dict``)."""
    model = build_model(state.get("spec") or model_spec(state["config"], state["vocab_size"]), overrides).to(device)
    model.load_state_dict(state["model"])
    return model.eval()
