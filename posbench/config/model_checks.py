"""The value checks of a config's ``model`` section (run by ``posbench.config.schema.finalize`` after
posbench/config/checks.py's): sizes and heads, the block's options, the temperature's, and hybrid layers (a pattern of
local and global layers, the L layers' window, the G layers' scheme, QK-norm). Each raises ``ConfigError``, one line
naming the value and what is allowed; some fill a derived default in place (``model.scale_length``, the global
scheme's options), as their docstrings say.

    model_values(cfg.model, L);  layers(cfg.model, cfg.scheme.name, L, longest)
"""

from __future__ import annotations

import dataclasses
import math

from omegaconf import DictConfig, OmegaConf, open_dict

from posbench.attention.temperature import BETA, ZERO_SHOT, default_length, first_scaled
from posbench.attention.windows import expand_pattern
from posbench.config.checks import ConfigError, positive
from posbench.schemes import SCHEMES, PositionalScheme


def embeddings_scaled(block: str, given: bool | None) -> bool:
    """Whether token embeddings are multiplied by √D: ``given``, or where it is None the ``block``'s convention: yes in
    the GPT block (posbench's recipe for every scheme, fairseq's ``embed_scale``: docs/design.md §2), no in the Llama
    block (Touvron et al. 2023; transformers' LlamaModel embeds tokens unscaled)."""
    return block == "gpt" if given is None else bool(given)


def model_values(m: DictConfig, seq_len: int) -> None:
    """``model.*``: ``model.scale_embeddings`` filled (None → the block's: :func:`embeddings_scaled`), sizes, heads
    that divide the width into even head dimensions (or an even ``model.head_dim``), key/value heads that divide the
    query heads, a positive ``model.norm_eps``, dropouts in [0, 1), and the temperature's options
    (posbench/attention/temperature.py): ``model.scale_length`` (filled: None → ``seq_len``, the length the weights are
    trained at; ``seq_len`` + 1 for floor_log_n), a zero-shot temperature's 1 at every index below ``seq_len``,
    ``model.scale_beta`` (> 0) and ``model.scale_layers`` only where they apply."""
    m.scale_embeddings = embeddings_scaled(m.block, m.scale_embeddings)
    for key in ("n_layer", "n_head", "d_model", "d_ff", "n_kv_head", "head_dim"):
        if m[key] is not None:  # (n_kv_head, head_dim: None = n_head, d_model / n_head)
            positive(f"model.{key}", m[key])
    if m.head_dim is None and m.d_model % m.n_head:
        raise ConfigError(f"model.n_head={m.n_head} does not divide model.d_model={m.d_model}: give model.head_dim")
    if (m.head_dim or m.d_model // m.n_head) % 2:
        raise ConfigError(f"head dim {'model.head_dim' if m.head_dim else 'd_model/n_head'}="
                          f"{m.head_dim or m.d_model // m.n_head} must be even")
    if m.n_kv_head is not None and m.n_head % m.n_kv_head:
        raise ConfigError(f"model.n_kv_head={m.n_kv_head} does not divide model.n_head={m.n_head}: each key/value head "
                          "serves n_head / n_kv_head query heads")
    if not (math.isfinite(m.norm_eps) and m.norm_eps > 0):
        raise ConfigError(f"model.norm_eps={m.norm_eps} is not allowed: a norm's epsilon must be > 0")
    for key in ("dropout", "attn_dropout"):
        if not 0 <= m[key] < 1:  # (NaN fails it too)
            raise ConfigError(f"model.{key}={m[key]} is not allowed: it is a dropout probability, 0 <= p < 1")
    floor, zero_shot = m.attn_scale in ("floor_log", "floor_log_n"), m.attn_scale in ZERO_SHOT
    if m.scale_beta != BETA and not floor:
        raise ConfigError(f"model.scale_beta={m.scale_beta} applies to model.attn_scale=floor_log or floor_log_n "
                          f"(model.attn_scale={m.attn_scale}): drop it")
    if floor and not (math.isfinite(m.scale_beta) and m.scale_beta > 0):
        raise ConfigError(f"model.scale_beta={m.scale_beta} is not allowed: the floor-log temperature's beta must be "
                          f"> 0 (default {BETA})")
    if m.scale_layers != "all" and not zero_shot:
        raise ConfigError(f"model.scale_layers={m.scale_layers} applies to the zero-shot temperatures (model.attn_scale="
                          f"{' or '.join(ZERO_SHOT)}; model.attn_scale={m.attn_scale}): drop it")
    if m.attn_scale in ("none", "ssmax"):
        if m.scale_length is not None:
            raise ConfigError(f"model.scale_length={m.scale_length} applies to model.attn_scale=log_n, "
                              f"{', '.join(ZERO_SHOT)} only (model.attn_scale={m.attn_scale}): drop it")
        return
    if m.scale_length is None:
        m.scale_length = default_length(m.attn_scale, seq_len)
    if m.scale_length < 2:
        raise ConfigError(f"model.scale_length={m.scale_length} is not allowed: it must be >= 2 (log-n scaling divides "
                          "by ln L; a floor-log F of 1 scales every position)")
    first = first_scaled(m.attn_scale, m.scale_length) if zero_shot else seq_len
    if first < seq_len:
        need = default_length(m.attn_scale, seq_len)
        raise ConfigError(f"model.scale_length={m.scale_length} makes model.attn_scale={m.attn_scale} scale the queries "
                          f"from index {first} on, within the train length L={seq_len}, where the weights never saw a "
                          f"temperature: a zero-shot temperature is 1 within L; give model.scale_length >= {need}")


def global_name(m: DictConfig) -> list[str]:
    """The name of ``model.global_scheme`` in a list (a name, or a section's ``name``), or [] when there is none."""
    g = m.get("global_scheme")
    if g is None:
        return []
    return [g] if isinstance(g, str) else [g.get("name")] if isinstance(g, (dict, DictConfig)) else [str(g)]


def layers(m: DictConfig, scheme: str, seq_len: int, longest: int) -> None:
    """Hybrid layers (posbench/model/gpt.py ``GPT``): ``model.layer_pattern`` (L and G letters), the L layers' window
    (1 ≤ W < L, ``train.seq_len``: a window of L or more hides no key in training; an L layer needed; not with a
    length-dependent ``model.attn_scale``, whose n, the keys a query sees, a window caps), the G
    layers' ``model.global_scheme`` (read as a scheme section and resolved in place, as ``scheme`` is: its name known,
    its options the scheme's, its derived ones filled from ``seq_len``; a G and an L layer needed; no scheme that
    embeds positions beside it), QK-norm's options only with ``model.qk_norm=rms`` (``local`` needs an L layer), and a
    pattern with L layers only when something makes them differ from the G ones."""
    try:
        kinds = expand_pattern(m.layer_pattern, m.n_layer)
    except ValueError as err:
        raise ConfigError(f"model.{err}") from None
    W, g = m.window, global_name(m)
    if W is not None:
        positive("model.window", W)
        if "L" not in kinds:
            raise ConfigError(f"model.window={W} applies to the L layers, and model.layer_pattern={m.layer_pattern} has "
                              f"none at {m.n_layer} layers: give a pattern with L layers, e.g. LLLG, or drop the window")
        if W >= seq_len:
            raise ConfigError(f"model.window={W} is not below train.seq_len={seq_len}: a window of L tokens or more hides "
                              f"no key in training, so the L layers would train as global ones; give 1 <= model.window "
                              f"< {seq_len}")
    elif m.window_kind != "sliding":
        raise ConfigError(f"model.window_kind={m.window_kind} applies to model.window: give model.window=<tokens>")
    if W is not None and m.attn_scale in ("log_n", "ssmax"):
        raise ConfigError(f"model.attn_scale={m.attn_scale} scales a query by the t + 1 keys it sees, and model.window="
                          f"{W} caps them at W in the L layers: the two are not defined together; drop one of them")
    if m.qk_norm == "none" and (m.qk_norm_layers != "all" or m.qk_norm_weight is not True):
        key = "qk_norm_layers" if m.qk_norm_layers != "all" else "qk_norm_weight"
        raise ConfigError(f"model.{key}={m[key]} applies to QK-norm: add model.qk_norm=rms, or drop it")
    if m.scale_layers == "global" and not ("L" in kinds and "G" in kinds):
        raise ConfigError(f"model.scale_layers=global scales the G layers beside L layers, and model.layer_pattern="
                          f"{m.layer_pattern} at {m.n_layer} layers has {'no L' if 'L' not in kinds else 'no G'} layer: "
                          "give a pattern with both, e.g. LLLG, or model.scale_layers=all")
    if m.qk_norm == "rms" and m.qk_norm_layers == "local" and "L" not in kinds:
        raise ConfigError(f"model.qk_norm_layers=local applies to the L layers, and model.layer_pattern="
                          f"{m.layer_pattern} has none")
    if g and SCHEMES[scheme].embed is not PositionalScheme.embed:
        raise ConfigError(f"scheme={scheme} adds positions to the embeddings, once, before the first layer: it cannot "
                          f"be the scheme of the L layers beside model.global_scheme={g[0]}")
    if g:
        _global_scheme(m, kinds, seq_len, longest)
    elif "L" in kinds and W is None and not (m.qk_norm == "rms" and m.qk_norm_layers == "local"):
        raise ConfigError(f"model.layer_pattern={m.layer_pattern}: its L layers differ from G layers only by "
                          "model.window, model.global_scheme or model.qk_norm_layers=local; give one, or drop the pattern")


def _global_scheme(m: DictConfig, kinds: str, seq_len: int, longest: int) -> None:
    """Read ``model.global_scheme`` as a scheme section, resolve it (its Config's ``resolve``) and write it back."""
    g = m.global_scheme
    section = {"name": g} if isinstance(g, str) else OmegaConf.to_container(g) if isinstance(g, DictConfig) else g
    if not isinstance(section, dict) or not isinstance(section.get("name"), str):
        raise ConfigError(f"model.global_scheme={g!r} is not allowed: give a scheme's name, or "
                          "'{name: <scheme>, <option>: <value>}'")
    name = section.pop("name")
    if name not in SCHEMES:
        raise ConfigError(f"model.global_scheme: unknown scheme {name!r}; choose one of: {', '.join(sorted(SCHEMES))}")
    if "G" not in kinds or "L" not in kinds:
        raise ConfigError(f"model.global_scheme={name} is the scheme of the G layers beside the L layers' scheme, and "
                          f"model.layer_pattern={m.layer_pattern} has {'no G' if 'G' not in kinds else 'no L'} layer at "
                          f"{m.n_layer} layers" + ("" if "G" not in kinds else f"; give scheme={name} instead"))
    if SCHEMES[name].embed is not PositionalScheme.embed:
        raise ConfigError(f"model.global_scheme={name} adds positions to the embeddings, once, before the first layer: "
                          "it cannot be the scheme of some layers only")
    try:
        config = SCHEMES[name].make_config(**section)
        config.resolve(seq_len, longest)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"model.global_scheme.{err}") from None
    with open_dict(m):
        m.global_scheme = {"name": name, **dataclasses.asdict(config)}
