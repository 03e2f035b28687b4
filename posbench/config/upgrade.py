"""Records written by an older posbench, read as today's: configs and model specs of checkpoints, training states and
results records (docs/design.md §7.4).

Every key a record lacks reads as its default, except where the default would misdescribe what was recorded:

* format 1 scaled token embeddings by √D for sinusoidal only: ``model.scale_embeddings`` reads as
  ``scheme.name == "sinusoidal"`` there;
* formats 1 and 2 recorded ``base`` and ``max_positions`` for every scheme: below format 3 the options a scheme's
  ``Config`` lacks are dropped;
* a rotary scheme section with ``scaling: yarn`` but no ``yarn_ramp`` in a results record of format 3 or older, or in
  a checkpoint or training state (format 3, which records every option since ``yarn_ramp`` exists), was written with
  the paper's ramp, before the reference ramp became the default: its ``yarn_ramp`` reads as ``paper``;
* a recorded section of a scheme with a ``per_layer`` option (FIRE) but without the key was written when one
  instance served every layer: its ``per_layer`` reads as false (today's records hold every option);
* a recorded ``eval.passkey`` without ``keys`` was written when keys were the frequent words: its ``keys`` reads as
  ``frequent``;
* a recorded model section (a config's or a spec's) without ``attn_dropout`` was written when ``model.dropout`` drove
  the attention dropout too: its ``attn_dropout`` reads as its ``dropout``, so that the rebuilt model, and a resumed
  run, trains as it did (resuming it with today's ``attn_dropout`` default, 0, is refused as a changed key);
* a model section without ``scale_embeddings`` (or with None) reads as its block's convention, ×√D in the GPT block
  and not in the Llama block (``posbench.config.model_checks.embeddings_scaled``), as it was trained.
"""

from __future__ import annotations

import copy
import dataclasses

from omegaconf import OmegaConf

from posbench.config.checks import ConfigError
from posbench.config.model_checks import embeddings_scaled
from posbench.config.schema import DEFAULT_SCHEME, ModelConfig, PosbenchConfig, scheme_schema, to_dict
from posbench.schemes import SCHEMES


def scheme_section(scheme: dict, fmt: int | None = None) -> dict:
    """A recorded scheme section ``{"name": ..., **options}`` (format ``fmt``; None: today's) with the options today's
    scheme takes, keys it lacks left out (they read as the Config's defaults) but for the exceptions of the module
    docstring. Returns a new dict.

    Raises ConfigError for a section that is not a mapping, a scheme this posbench does not have, or (format 3 and
    later) an option the scheme lacks."""
    if not isinstance(scheme, dict):
        raise ConfigError(f"a recorded config does not fit this posbench's schema: scheme={scheme!r} is not a mapping")
    name = scheme.get("name", DEFAULT_SCHEME)
    if name not in SCHEMES:
        raise ConfigError(f"a recorded config has scheme.name={name!r}, which this posbench does not have; "
                          f"it has: {', '.join(sorted(SCHEMES))}")
    cls = SCHEMES[name]
    options = {k: v for k, v in scheme.items() if k != "name"}
    if fmt is not None and fmt < 3:  # formats 1 and 2 recorded base and max_positions for every scheme
        options = {k: v for k, v in options.items() if k in cls.options()}
    if fmt is not None and fmt < 4 and "yarn_ramp" in cls.options() and options.get("scaling") == "yarn":
        options.setdefault("yarn_ramp", "paper")  # recorded before scheme.yarn_ramp existed: the paper's ramp
    if fmt is not None and "per_layer" in cls.options():
        options.setdefault("per_layer", False)  # recorded before per-layer schemes existed: shared
    try:
        cls.make_config(**options)
    except ValueError as e:
        raise ConfigError(f"a recorded config does not fit this posbench's schema: scheme.{e}") from None
    return {"name": name, **options}


def model_section(model: dict) -> dict:
    """A recorded spec's model section with every key of today's ``ModelConfig`` (but ``name``) it lacks at its default
    (``attn_scale: none`` for a model from before the option: what it was), but ``attn_dropout``, which reads as its
    ``dropout`` (module docstring), and a ``global_scheme`` given by name as its section ``{"name": ...}``; the one
    reader of a spec's model section (posbench.model.build.build_model, posbench.model.memory). Returns a new dict."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name != "name"}
    section = {**defaults, "attn_dropout": model.get("dropout", defaults["dropout"]), **model}
    if isinstance(section["global_scheme"], str):  # a global scheme by name: its section
        section["global_scheme"] = {"name": section["global_scheme"]}
    section["scale_embeddings"] = embeddings_scaled(section["block"], section["scale_embeddings"])
    return section


def upgrade(config: dict, fmt: int | None = None) -> dict:
    """A config recorded by posbench (a checkpoint's, a training state's or a results record's, format ``fmt``;
    None: today's format, or a partial config) as a full config of today's schema: every key it lacks at its
    default (``scheme.name``: :data:`~posbench.config.schema.DEFAULT_SCHEME`; the scheme's options: its ``Config``
    defaults), but for the exceptions of the module docstring. Returns a new plain dict.

    Raises ConfigError when the recorded config does not fit the schema (a key it does not know, a scheme
    option the scheme lacks in a format-3 config, a scheme this posbench does not have, a wrong type).
    """
    config = copy.deepcopy(config)
    config["scheme"] = scheme = scheme_section(config.get("scheme", {}), fmt)
    probe = (config.get("eval") or {}).get("passkey")
    if isinstance(probe, dict):
        probe.setdefault("keys", "frequent")
    if fmt is not None and fmt < 2 and isinstance(config.get("model"), dict):
        config["model"].setdefault("scale_embeddings", scheme["name"] == "sinusoidal")
    if isinstance(config.get("model"), dict):  # recorded before model.attn_dropout: dropout drove the attention's too
        config["model"].setdefault("attn_dropout", config["model"].get("dropout", ModelConfig.dropout))
    try:
        base = OmegaConf.structured(PosbenchConfig)
        base.scheme = OmegaConf.structured(scheme_schema(scheme["name"]))
        out = to_dict(OmegaConf.merge(base, config))
    except Exception as e:  # noqa: BLE001 - OmegaConf's validation errors, of many kinds
        raise ConfigError(f"a recorded config does not fit this posbench's schema: {str(e).splitlines()[0]}") from None
    out["model"]["scale_embeddings"] = embeddings_scaled(out["model"]["block"], out["model"]["scale_embeddings"])
    return out
