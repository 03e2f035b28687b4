"""The value checks of a composed config: one checker per section, run in order by ``posbench.config.schema.finalize``.

Closed choices (``train.schedule``, ``eval.protocol``, ``eval.probes``, …) are declared once, on their schema field
(``field(metadata={"choices": ...})``: posbench/config/schema.py), and :func:`check_choices` checks them all in one loop,
so a new choice is one tuple, not one more hand-written check. Every other value has its section's checker:

    check_keys(cfg, PosbenchConfig());  check_choices(cfg, PosbenchConfig)
    run_values(cfg); train_values(cfg.train, cfg.init_from, training); data_values(cfg.data)
    training_positions(cfg.train, schemes, cfg.eval)

The model section's checkers are posbench/config/model_checks.py's, the evaluation's and the remap's
posbench/config/eval_checks.py's. Each raises :class:`ConfigError`, one
line naming the value and what is allowed; some fill a derived default in
place (``eval.lengths``, ``model.scale_length``, ``train.compile``), as their docstrings say.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from omegaconf import DictConfig, ListConfig

from posbench.runtime.device import native_bf16_cpu, resolve_device
from posbench.schemes import SCHEMES

log = logging.getLogger("posbench")


class ConfigError(ValueError):
    """A bad configuration value; the CLI prints its message as one line and exits with status 2."""


def choices(*options: str, **kwargs) -> dataclasses.Field:
    """A schema field whose value (or, for a list, each item) must be one of ``options``; the first is the
    default of a plain field (pass ``default_factory=list`` for a list)."""
    if "default_factory" not in kwargs:
        kwargs.setdefault("default", options[0])
    return dataclasses.field(metadata={"choices": tuple(options)}, **kwargs)


def positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} is not allowed: it must be a positive integer")


def check_keys(node: DictConfig, known, prefix: str = "", shown_by: str = "posbench train --cfg job") -> None:
    """Reject keys the schema instance ``known`` lacks (Hydra's ``+key=value`` lifts struct mode, so composition
    alone lets them in); the error names the command that shows the keys, ``shown_by``."""
    for key in node:
        if not hasattr(known, key):
            raise ConfigError(f"unknown config key {prefix + key!r}; see the keys with: {shown_by}")
        if dataclasses.is_dataclass(getattr(known, key)):
            check_keys(node[key], getattr(known, key), f"{prefix}{key}.", shown_by)


def check_choices(node: DictConfig, schema: type, prefix: str = "") -> None:
    """Check every field of the dataclass ``schema`` that declares ``choices`` (:func:`choices`), in its
    sections too: ``train.schedule='cosin'`` → "train.schedule='cosin' is unknown; choose one of: cosine,
    constant"; a list field is checked item by item ("eval.probes has 'contxt'; the probes: passkey, context")."""
    for f in dataclasses.fields(schema):
        value = node.get(f.name) if isinstance(node, DictConfig) else None
        key, allowed = prefix + f.name, f.metadata.get("choices")
        if allowed and isinstance(value, (list, ListConfig)):
            for item in value:
                if item not in allowed:
                    raise ConfigError(f"{key} has {item!r}; the {f.name}: {', '.join(allowed)}")
        elif allowed and value is not None and value not in allowed:
            raise ConfigError(f"{key}={value!r} is unknown; choose one of: {', '.join(allowed)}")
        elif isinstance(value, DictConfig) and dataclasses.is_dataclass(f.default_factory):
            check_choices(value, f.default_factory, f"{key}.")


def check_device(key: str, name: str) -> None:
    """Raise ConfigError for a device other than auto / cpu / cuda[:n], or CUDA on a machine without it."""
    if name != "auto" and name != "cpu" and not name.startswith("cuda"):
        raise ConfigError(f"{key}={name!r} is unknown; choose auto, cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{key}={name!r} but no CUDA device is available; use {key}=cpu or auto")


def compile_default(setting: bool | None, device: str) -> bool:
    """``train.compile`` as a run on ``device`` (a checked ``train.device``: auto, cpu, cuda[:n]) uses it: the
    ``setting`` when given, else (None) True where the device is CUDA and False on the CPU."""
    return setting if setting is not None else resolve_device(device).type == "cuda"


def longest_length(e: DictConfig) -> int:
    """The longest window an evaluation config scores: its longest evaluation length, or probe length when it
    probes (``eval.probes``)."""
    return max([*e.lengths, *(e.passkey.lengths if "passkey" in e.probes and e.passkey.lengths else [])])


# ---- the sections ------------------------------------------------------------------------------------------


def run_values(cfg: DictConfig) -> None:
    """The run's own keys: ``seed``, the scheme's name, and ``init_rows`` without ``init_from``."""
    if cfg.seed < 0:
        raise ConfigError(f"seed={cfg.seed} is not allowed: it must be an integer >= 0")
    if cfg.scheme.name not in SCHEMES:
        raise ConfigError(f"unknown scheme {cfg.scheme.name!r}; choose one of: {', '.join(sorted(SCHEMES))}")
    if cfg.init_rows != "scheme" and cfg.init_from is None:
        raise ConfigError(f"init_rows={cfg.init_rows} applies to a run started from a parent: add init_from=<run folder>")


def train_values(t: DictConfig, init_from: str | None, training: bool) -> None:
    """``train.*``: sizes, steps (0 only with ``init_from``), the optimizer's values, checkpoints, and, when
    ``training`` (a training job, not a re-evaluation of a recorded config), the device (``train.compile`` filled:
    :func:`compile_default`) and a warning when the warmup takes every step."""
    for key in ("seq_len", "batch_size", "log_every"):
        positive(f"train.{key}", t[key])
    if t.steps == 0 and init_from is None:
        raise ConfigError("train.steps=0 needs init_from=<run folder> (0 steps: a parent's weights evaluated as they "
                          "are); a run from scratch needs a positive train.steps")
    if t.steps != 0:
        positive("train.steps", t.steps)
    _optimizer_values(t)
    if t.sync_every is not None:
        positive("train.sync_every", t.sync_every)
    if t.checkpoint_every < 0 or t.keep_checkpoints < 1:
        raise ConfigError("train.checkpoint_every must be >= 0 and train.keep_checkpoints >= 1")
    if not training:  # (posbench eval reads a run's recorded train.device, which need not exist on this machine)
        return
    check_device("train.device", t.device)
    t.compile = compile_default(t.compile, t.device)
    if t.precision == "bf16" and resolve_device(t.device).type == "cpu" and not native_bf16_cpu():
        raise ConfigError("train.precision=bf16 but this CPU has no native bfloat16 (AVX512-BF16 or AMX), where bf16 "
                          "autocast runs slower than float32; choose train.precision=fp32 or auto")
    if 0 < t.steps <= t.warmup_steps:  # (posbench/training/loop.py lr_factor: step i < W takes lr · (i + 1) / W)
        end = (f"reaches train.lr={t.lr:g} only at the last step" if t.steps == t.warmup_steps else
               f"ends at {t.steps}/{t.warmup_steps} of train.lr={t.lr:g}, never reaching it")
        log.warning("train.warmup_steps=%d >= train.steps=%d: every step is a warmup step, and the learning rate %s; "
                    "give train.warmup_steps below %d", t.warmup_steps, t.steps, end, t.steps)


def _optimizer_values(t: DictConfig) -> None:
    """Values that would silently break training: each refused with the value and what is allowed."""
    if not (math.isfinite(t.lr) and t.lr > 0):  # (nan and inf fail every comparison that would let them through)
        raise ConfigError(f"train.lr={t.lr} is not allowed: it must be a finite number > 0")
    if not 0 <= t.min_lr <= t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} is not allowed: it must be between 0 and train.lr={t.lr} "
                          "(the cosine schedule decays from lr to min_lr)")
    if t.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps={t.warmup_steps} is not allowed: it must be >= 0")
    if not (math.isfinite(t.weight_decay) and t.weight_decay >= 0):
        raise ConfigError(f"train.weight_decay={t.weight_decay} is not allowed: it must be >= 0")
    if not t.grad_clip >= 0:
        raise ConfigError(f"train.grad_clip={t.grad_clip} is not allowed: it must be > 0 (the largest gradient norm) "
                          "or 0 (no clipping)")
    betas = list(t.betas)
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ConfigError(f"train.betas={betas} is not allowed: give two AdamW betas, each 0 <= beta < 1")


def data_values(d: DictConfig) -> None:
    """``data.*``: the vocabulary size, the training data's needles (``data.passkey_*``) and copy windows
    (``data.copy_*``)."""
    positive("data.vocab_size", d.vocab_size)
    for key in ("passkey_rate", "copy_rate"):
        if not 0 <= d[key] <= 1:
            raise ConfigError(f"data.{key}={d[key]} is not allowed: it is a fraction of training windows, between 0 and 1")
    positive("data.passkey_pairs", d.passkey_pairs)
    if not 0 < d.copy_until <= 1:
        raise ConfigError(f"data.copy_until={d.copy_until} is not allowed: it is the fraction of train.steps at which "
                          "copy windows end, in (0, 1]")


def inert(values: dict, defaults, prefix: str, on: bool, needs: str) -> None:
    """Refuse an option among ``values`` (key → value) set away from its default (``defaults``: the schema's
    instance) while what it acts through is off (``on`` false): it would be accepted and do nothing. ``needs``
    names what turns it on."""
    changed = [k for k, v in values.items() if v is not None and v != getattr(defaults, k)]
    if changed and not on:
        value = values[changed[0]]
        value = list(value) if isinstance(value, ListConfig) else value
        raise ConfigError(f"{prefix}{changed[0]}={value} does nothing without {needs}, or drop it")


def training_data_inert(d: DictConfig, defaults) -> None:
    """A training run's ``data.passkey_pairs`` without ``data.passkey_rate`` and ``data.copy_until`` without
    ``data.copy_rate`` (:func:`inert`; ``defaults``: the data schema's instance); a re-evaluation reads the recorded
    ones, which trained nothing."""
    inert({"passkey_pairs": d.passkey_pairs}, defaults, "data.", d.passkey_rate > 0,
          "needles in the training windows: add data.passkey_rate=<fraction>")
    inert({"copy_until": d.copy_until}, defaults, "data.", d.copy_rate > 0,
          "copy windows in the training windows: add data.copy_rate=<fraction>")


def training_positions(t: DictConfig, schemes: list[str], e: DictConfig) -> None:
    """The training positions other than 0…L−1: ``train.random_positions`` (M) and ``train.pose`` (L_t), each at
    least L, not both, for a model whose ``schemes`` (the run's, and a hybrid's global one) read positions;
    ``train.pose_chunks`` in 2…L and only with ``train.pose``; a warning when M or L_t is below the longest evaluation
    length (positions from there on are never seen in training)."""
    M, Lt, N = t.random_positions, t.pose, t.pose_chunks
    if N != 2 and Lt is None:
        raise ConfigError(f"train.pose_chunks={N} applies to PoSE: add train.pose=<target length>, or drop it")
    for key, value in (("random_positions", M), ("pose", Lt)):
        if value is None:
            continue
        positive(f"train.{key}", value)
        if value < t.seq_len:
            what = ("a window's positions are distinct integers drawn from [0, M)" if key == "random_positions" else
                    "PoSE spreads a window's L positions over [0, L_t)")
            raise ConfigError(f"train.{key}={value} is smaller than train.seq_len={t.seq_len}: {what}")
        if not any(SCHEMES[s].reads_positions() for s in schemes if s in SCHEMES):
            which = f"scheme={schemes[0]}" + (f" and model.global_scheme={schemes[1]} use" if len(schemes) > 1 else " uses")
            raise ConfigError(f"train.{key}={value} but {which} no positions: drop train.{key}, or choose a scheme that "
                              "reads them")
        if value < longest_length(e):
            log.warning("train.%s=%d is below the longest evaluation length %d: positions from %d on are never seen "
                        "in training", key, value, longest_length(e), value)
    if M is not None and Lt is not None:
        raise ConfigError(f"train.random_positions={M} and train.pose={Lt} both choose the training positions: "
                          "give one of them")
    if Lt is not None and (isinstance(N, bool) or not isinstance(N, int) or not 2 <= N <= t.seq_len):
        raise ConfigError(f"train.pose_chunks={N} is not allowed: PoSE cuts a window of train.seq_len={t.seq_len} "
                          f"tokens into 2…{t.seq_len} chunks (its first chunk starts at position 0)")
