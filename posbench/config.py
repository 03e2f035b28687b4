"""The configuration's schema and its checks: what Hydra composes into, and what a finished config must satisfy.

The dataclasses below are the structured configs of ``posbench train`` (:class:`PosbenchConfig`) and ``posbench
eval`` (:func:`eval_schema`); a misspelt key or a wrong type fails at composition. The ``scheme`` node takes one
schema per registered scheme, made from the scheme's own ``Config`` by :func:`scheme_schema` (posbench/schemes/):
``scheme=learned scheme.max_positions=64`` is checked against the learned scheme's fields, and ``scheme=rope
scheme.max_positions=64`` fails at composition. posbench/cli.py stores them in Hydra's ConfigStore.
:func:`finalize` fills the derived defaults (evaluation lengths, the scheme's ``Config.resolve``) and checks every
value (:class:`ConfigError`) before any data is read or any step is trained.

Scheme, model and data code never see these objects: the jobs hand them plain values.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import typing
from dataclasses import dataclass, field, is_dataclass
from typing import Any, List, Optional

import torch
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from posbench import context, passkey
from posbench.attention import ATTN_SCALES
from posbench.device import resolve_device
from posbench.schemes import SCHEMES

PROTOCOLS = ("nonoverlapping", "sliding")
INIT_ROWS = ("scheme", "interpolate")  # init_rows: posbench/lineage.py
SPLITS = ("validation", "test")
log = logging.getLogger("posbench")
DEFAULT_SCHEME = "rope"  # a recorded config without scheme.name (train.yaml's default, the old schema's too)


class ConfigError(ValueError):
    """A bad configuration value; the CLI prints its message as one line and exits with status 2."""


@dataclass
class ModelConfig:
    name: str = "tiny"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int = 512
    dropout: float = 0.0  # residual and embedding dropout, 0 <= p < 1
    attn_dropout: float = 0.0  # attention-probability dropout, 0 <= p < 1 (any > 0 moves bias schemes off Flex on CUDA)
    scale_embeddings: bool = True  # token embeddings × sqrt(d_model) for every scheme (fairseq; docs/design.md §2)
    attn_scale: str = "none"  # none | log_n | ssmax: queries × a factor of the keys they see (posbench/model.py GPT)
    scale_length: Optional[int] = None  # L of log_n's ln n / ln L; None = the train length (log_n only)


@dataclass
class DataConfig:
    name: str = "shakespeare"
    vocab_size: int = 4096
    cache_dir: Optional[str] = None  # None = $POSBENCH_CACHE or ~/.cache/posbench
    validation: List[str] = field(default_factory=list)  # held-out documents (plays) for validation
    test: List[str] = field(default_factory=list)  # held-out documents (plays) for test
    train_files: List[str] = field(default_factory=list)  # data=text: files or folders
    validation_files: List[str] = field(default_factory=list)
    test_files: List[str] = field(default_factory=list)
    path: Optional[str] = None  # hub corpora: a local copy instead of the Hub name
    num_proc: int = 1  # tokenization worker processes
    tokenizer_train_chars: Optional[int] = None  # train the BPE on the first N characters of train (None = all)
    max_train_docs: Optional[int] = None  # keep the first N train documents (None = all; PG-19 streams them)
    max_train_tokens: Optional[int] = None  # stop the train split after N tokens (None = all)
    passkey_rate: float = 0.0  # fraction of training windows given needle + query pairs (posbench/passkey.py); 0 = none
    passkey_pairs: int = 1  # needle + query pairs per needled window, each its own key (several: log-uniform distances)
    copy_rate: float = 0.0  # fraction of training windows made [span, separator, same span] at step 0; 0 = none
    copy_until: float = 0.5  # the copy rate falls linearly to 0 at this fraction of train.steps


SCHEDULES = ("cosine", "constant")  # train.schedule: posbench/train.py lr_factor


@dataclass
class TrainConfig:
    seq_len: int = 128  # the train length L, in tokens
    batch_size: int = 16  # sequences per step
    steps: int = 700
    lr: float = 2e-3
    min_lr: float = 2e-4  # end of the cosine decay
    warmup_steps: int = 40
    schedule: str = "cosine"  # cosine (warmup, then decay to min_lr) | constant (warmup, then lr: PI's fine-tuning)
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    device: str = "auto"  # auto | cpu | cuda (refused before any folder is touched when CUDA is absent)
    threads: Optional[int] = None  # torch CPU threads; None = the cores this process may use
    log_every: int = 50
    checkpoint_every: int = 0  # steps between training checkpoints; 0 = only at the end
    keep_checkpoints: int = 2  # newest training checkpoints kept
    check_memory: bool = True  # refuse a run whose estimated step memory exceeds what the device has free
    compile: Optional[bool] = None  # torch.compile the model; None = on CUDA, off on CPU (eager on failure)
    random_positions: Optional[int] = None  # M: train on sorted random positions from [0, M) (Ruoss et al. 2023)
    sync_every: Optional[int] = None  # steps between host syncs (NaN and stop checks, metrics); None = 1 on CPU, 16 on CUDA


PROBES = ("passkey", "context")  # eval.probes


@dataclass
class EvalConfig:
    lengths: Optional[List[int]] = None  # None = L, 2L, 4L, 8L, 16L
    protocol: str = "nonoverlapping"
    stride: Optional[int] = None  # sliding-window stride S
    split: str = "validation"
    max_tokens: Optional[int] = None  # budget: targets scored per evaluation length; None = the whole split
    batch_tokens: int = 16384  # tokens per forward pass
    probes: List[str] = field(default_factory=list)  # beside perplexity: passkey, context
    probe_every: int = 0  # training steps between passkey probes at L and the longest probe length; 0 = none
    passkey: passkey.Config = field(default_factory=passkey.Config)  # the probe owns its options and their checks
    context: context.Config = field(default_factory=context.Config)  # context use past L (posbench/context.py)


@dataclass
class WandbConfig:
    enabled: bool = True  # offline unless WANDB_MODE says otherwise; WANDB_MODE=disabled turns it off
    project: str = "posbench"
    entity: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class PosbenchConfig:
    scheme: Any = MISSING  # one of the scheme group's schemas (scheme_schema): name + the scheme's Config fields
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    seed: int = 0
    resume: str = "auto"  # auto: continue from the run folder's newest valid checkpoint; never: start over
    resume_any_world_size: bool = False  # resume under another torchrun world size (recorded as world_sizes)
    init_from: Optional[str] = None  # start from this run's weights (its folder or checkpoint.pt): posbench/lineage.py
    init_rows: str = "scheme"  # rows a learned table gains from the parent: scheme (initialised) | interpolate (PI)


@dataclass
class EvalJobConfig:
    """``posbench eval``: re-evaluate the checkpoint in ``run`` with these evaluation settings."""

    run: str = MISSING  # a run folder holding checkpoint.pt
    eval: EvalConfig = field(default_factory=EvalConfig)
    device: str = "auto"
    threads: Optional[int] = None
    scheme: Any = None  # options of the run's scheme to change (scheme.scaling=yarn); the stored schema: eval_schema()


# ---- schemas made from the registry ------------------------------------------------------------------------

_MADE: dict[str, type] = {}  # the dataclasses made by schema(), by name


def schema(name: str, fields: list[tuple[str, Any, dataclasses.Field]], bases: tuple = ()) -> type:
    """The dataclass ``name`` with ``fields`` ((field name, type, ``dataclasses.field(...)``), in order) over
    ``bases``: made once per distinct definition, and findable as ``posbench.config.<name>``, so that configs holding
    it pickle (joblib and SLURM sweeps), in a fresh process too."""
    key = (tuple((n, t, f.default, f.default_factory) for n, t, f in fields), bases)
    made = _MADE.get(name)
    if made is None or made.definition != key:
        made = dataclasses.make_dataclass(name, fields, bases=bases, namespace={"definition": key})
        made.__module__ = __name__
        _MADE[name] = made
    return made


def _options(config_class: type, optional: bool = False) -> list[tuple[str, Any, dataclasses.Field]]:
    """A scheme Config's fields as :func:`schema` fields: their types and defaults, or (``optional``) their types
    made Optional with default None ("not given")."""
    types = typing.get_type_hints(config_class)
    return [(f.name, Optional[types[f.name]], field(default=None)) if optional else
            (f.name, types[f.name], field(default=f.default, default_factory=f.default_factory))
            for f in dataclasses.fields(config_class)]


def scheme_schema(name: str) -> type:
    """The structured config of the scheme registered as ``name``: ``name: str = <name>``, then the fields of
    the scheme's ``Config`` (types and defaults); ``posbench.config.scheme_<name>``. Raises KeyError for a name
    not in ``SCHEMES``."""
    return schema(f"scheme_{name}", [("name", str, field(default=name)), *_options(SCHEMES[name].Config)])


def eval_schema() -> type:
    """The structured config of ``posbench eval``: :class:`EvalJobConfig` whose ``scheme`` node takes every option of
    every registered scheme (Optional, default None: not given; an option two schemes type differently: Any), so
    that ``scheme.scaling=yarn`` composes and ``scheme.factor=abc`` or a key no scheme has fails at composition.
    Which of them the run's scheme has is checked by ``posbench.eval_job.prepare``."""
    options: dict[str, tuple] = {}
    for cls in SCHEMES.values():
        for key, kind, default in _options(cls.Config, optional=True):
            options[key] = (key, kind if options.get(key, (key, kind))[1] == kind else Any, default)
    scheme = schema("eval_options", list(options.values()))
    return schema("eval_job", [("scheme", scheme, field(default_factory=scheme))], bases=(EvalJobConfig,))


def scheme_of(made) -> str | None:
    """The scheme name whose :func:`scheme_schema` is ``made``, or None for any other object."""
    name = getattr(made, "__name__", "")
    return name[len("scheme_"):] if name.startswith("scheme_") and _MADE.get(name) is made else None


def __getattr__(attr: str):  # pickle looks a made schema up by name, in a fresh process too
    if attr.startswith("scheme_") and attr[len("scheme_"):] in SCHEMES:
        return scheme_schema(attr[len("scheme_"):])
    if attr in ("eval_job", "eval_options"):
        return eval_schema() if attr == "eval_job" else eval_schema().__dataclass_fields__["scheme"].type
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


# ---- checks ------------------------------------------------------------------------------------------------


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} is not allowed: it must be a positive integer")


def check_keys(node: DictConfig, known, prefix: str = "") -> None:
    """Reject keys the schema instance ``known`` lacks (Hydra's ``+key=value`` lifts struct mode, so composition
    alone lets them in)."""
    for key in node:
        if not hasattr(known, key):
            raise ConfigError(f"unknown config key {prefix + key!r}; see the keys with: posbench train --cfg job")
        if is_dataclass(getattr(known, key)):
            check_keys(node[key], getattr(known, key), f"{prefix}{key}.")


def _optimizer_values(t: DictConfig) -> None:
    """Values that would silently break training: each refused with the value and what is allowed."""
    if not (math.isfinite(t.lr) and t.lr > 0):  # (nan and inf fail every comparison that would let them through)
        raise ConfigError(f"train.lr={t.lr} is not allowed: it must be a finite number > 0")
    if not 0 <= t.min_lr <= t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} is not allowed: it must be between 0 and train.lr={t.lr} "
                          "(the cosine schedule decays from lr to min_lr)")
    if t.schedule not in SCHEDULES:
        raise ConfigError(f"train.schedule={t.schedule!r} is unknown; choose one of: {', '.join(SCHEDULES)}")
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


def check_device(key: str, name: str) -> None:
    """Raise ConfigError for a device other than auto / cpu / cuda[:n], or CUDA on a machine without it."""
    if name != "auto" and name != "cpu" and not name.startswith("cuda"):
        raise ConfigError(f"{key}={name!r} is unknown; choose auto, cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{key}={name!r} but no CUDA device is available; use {key}=cpu or auto")


def _eval_values(e: DictConfig, seq_len: int) -> None:
    """Fill ``eval.lengths`` (None → L·2^k, k = 0…4) and ``eval.context.stride`` (None → L // 8), and check the
    evaluation settings (the probes' options by their own checks: posbench/passkey.py, posbench/context.py)."""
    if e.max_tokens is not None:
        _positive("eval.max_tokens", e.max_tokens)
    _positive("eval.batch_tokens", e.batch_tokens)
    if isinstance(e.probe_every, bool) or not isinstance(e.probe_every, int) or e.probe_every < 0:
        raise ConfigError(f"eval.probe_every={e.probe_every!r} is not allowed: give the training steps between probes "
                          "(> 0), or 0 for none")
    if e.probe_every and "passkey" not in e.probes:
        raise ConfigError(f"eval.probe_every={e.probe_every} probes retrieval during training: add "
                          "'eval.probes=[passkey]', or drop eval.probe_every")
    if e.lengths is None:
        e.lengths = [seq_len * 2**k for k in range(5)]
    if len(e.lengths) == 0:
        raise ConfigError("eval.lengths=[] is empty: give at least one evaluation length >= 2")
    for n in e.lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ConfigError(f"evaluation length {n!r} in eval.lengths is not allowed: each must be an integer >= 2")
    if list(e.lengths) != sorted(set(e.lengths)):
        raise ConfigError(f"eval.lengths={list(e.lengths)} is not allowed: give increasing lengths without repeats, "
                          f"e.g. [{','.join(map(str, sorted(set(e.lengths))))}] (tables and ratios read them in order)")
    for probe in e.probes:
        if probe not in PROBES:
            raise ConfigError(f"eval.probes has {probe!r}; the probes: {', '.join(PROBES)}")
    if e.passkey.lengths is None:
        e.passkey.lengths = list(e.lengths)
    try:
        passkey.check(e.passkey)
        context.check(e.context, seq_len, list(e.lengths) if "context" in e.probes else None)  # fills the stride
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if e.protocol not in PROTOCOLS:
        raise ConfigError(f"eval.protocol={e.protocol!r} is unknown; choose one of: {', '.join(PROTOCOLS)}")
    if e.split not in SPLITS:
        raise ConfigError(f"eval.split={e.split!r} is unknown; choose one of: {', '.join(SPLITS)}")
    if e.protocol != "sliding" and e.stride is not None:
        raise ConfigError(f"eval.stride={e.stride} applies to eval.protocol=sliding only, and eval.protocol="
                          f"{e.protocol}: drop eval.stride, or add eval.protocol=sliding")
    if e.protocol == "sliding":
        if e.stride is None:
            raise ConfigError("eval.protocol=sliding needs eval.stride (1 <= stride <= the evaluation length)")
        if e.stride < 1 or e.stride > min(e.lengths):
            raise ConfigError(
                f"eval.stride={e.stride} is not allowed: it must be between 1 and the smallest evaluation length {min(e.lengths)}"
            )


def longest_length(e: DictConfig) -> int:
    """The longest window an evaluation config scores: its longest evaluation length, or probe length when it
    probes (``eval.probes``)."""
    return max([*e.lengths, *(e.passkey.lengths if "passkey" in e.probes and e.passkey.lengths else [])])


def finalize(cfg: DictConfig, training: bool = True, trained_length: int | None = None) -> DictConfig:
    """Fill derived defaults in place and check every value; return ``cfg``. Run once per job, by the job's
    ``prepare`` (posbench/train_job.py, posbench/eval_job.py), before any data is read or any step is trained.

    Derived: ``eval.lengths`` (None → L·2^k for k = 0…4), when ``training`` ``train.compile`` (None → whether the
    run's device is CUDA: :func:`compile_default`), and the scheme's options: ``cfg.scheme`` is read into the
    scheme's ``Config``, whose ``resolve(L, longest)`` fills and checks them (the learned scheme's
    ``max_positions``: None → 16·L, never derived from ``eval.*``, so the model, its initialisation included, does
    not depend on how it will be evaluated), and the resolved values are written back into ``cfg.scheme``.
    ``trained_length`` is the length the weights were trained at when that is not ``train.seq_len`` (a run started
    from a parent's weights, ``init_from``: the parent's L); derived scheme options are filled from it (RoPE's
    ``original_length``: the length a scaling method scales from), as is ``model.scale_length`` (log-n scaling's L).
    Logs a warning when ``train.random_positions`` (M) is below the longest evaluation length: positions past M
    are never seen in training.

    Raises:
        ConfigError: a key the schema lacks, a non-positive length or size, an evaluation length < 2, an empty
            ``eval.lengths``, heads that do not divide the width, an unknown scheme (the message lists the
            registered names), a scheme option the scheme lacks or its ``resolve`` refuses (the message
            starts ``scheme.<option>=<value>``, e.g. a learned table smaller than the longest length),
            protocol or split, ``model.dropout`` or ``model.attn_dropout`` outside [0, 1), an unknown
            ``model.attn_scale`` or a ``model.scale_length`` < 2 or given without ``log_n``,
            ``train.random_positions`` below L or for a scheme that reads no positions, a stride outside 1…min(lengths), ``train.steps=0`` without ``init_from`` (0 steps:
            a parent evaluated as it is), ``init_rows`` not in :data:`INIT_ROWS`, optimizer values that would break training
            (lr ≤ 0, min_lr outside 0…lr, weight_decay < 0, grad_clip < 0, betas outside [0, 1)), or, when
            ``training`` (a training job, not a re-evaluation of a recorded config), ``train.device=cuda`` on a
            machine without CUDA.
    """
    check_keys(cfg, PosbenchConfig())
    t, m, s = cfg.train, cfg.model, cfg.scheme
    if cfg.seed < 0:
        raise ConfigError(f"seed={cfg.seed} is not allowed: it must be an integer >= 0")
    if s.name not in SCHEMES:
        raise ConfigError(f"unknown scheme {s.name!r}; choose one of: {', '.join(sorted(SCHEMES))}")
    for key in ("seq_len", "batch_size", "log_every"):
        _positive(f"train.{key}", t[key])
    if t.steps == 0 and cfg.init_from is None:
        raise ConfigError("train.steps=0 needs init_from=<run folder> (0 steps: a parent's weights evaluated as they "
                          "are); a run from scratch needs a positive train.steps")
    if t.steps != 0:
        _positive("train.steps", t.steps)
    _curriculum(cfg.data)
    if cfg.init_rows not in INIT_ROWS:
        raise ConfigError(f"init_rows={cfg.init_rows!r} is unknown; choose one of: {', '.join(INIT_ROWS)}")
    if cfg.init_rows != "scheme" and cfg.init_from is None:
        raise ConfigError(f"init_rows={cfg.init_rows} applies to a run started from a parent: add init_from=<run folder>")
    for key in ("n_layer", "n_head", "d_model", "d_ff"):
        _positive(f"model.{key}", m[key])
    _positive("data.vocab_size", cfg.data.vocab_size)
    if m.d_model % m.n_head:
        raise ConfigError(f"model.n_head={m.n_head} does not divide model.d_model={m.d_model}")
    if (m.d_model // m.n_head) % 2:
        raise ConfigError(f"head dim d_model/n_head={m.d_model // m.n_head} must be even")
    _dropouts(m)
    _attention_scaling(m, trained_length or t.seq_len)
    _optimizer_values(t)
    if training:  # (posbench eval reads a run's recorded train.device, which need not exist on this machine)
        check_device("train.device", t.device)
        t.compile = compile_default(t.compile, t.device)
    _eval_values(cfg.eval, t.seq_len)
    if cfg.resume not in ("auto", "never"):
        raise ConfigError(f"resume={cfg.resume!r} is unknown; choose auto or never")
    if t.sync_every is not None:
        _positive("train.sync_every", t.sync_every)
    if t.random_positions is not None:
        _positive("train.random_positions", t.random_positions)
        if t.random_positions < t.seq_len:
            raise ConfigError(f"train.random_positions={t.random_positions} is smaller than train.seq_len={t.seq_len}: "
                              "a window's positions are distinct integers drawn from [0, M)")
        if not SCHEMES[s.name].reads_positions():
            raise ConfigError(f"train.random_positions={t.random_positions} but scheme={s.name} uses no positions: "
                              "drop train.random_positions, or choose a scheme that reads them")
        if t.random_positions < longest_length(cfg.eval):
            log.warning("train.random_positions=%d is below the longest evaluation length %d: positions from %d on are "
                        "never seen in training", t.random_positions, longest_length(cfg.eval), t.random_positions)
    if t.checkpoint_every < 0 or t.keep_checkpoints < 1:
        raise ConfigError("train.checkpoint_every must be >= 0 and train.keep_checkpoints >= 1")
    try:
        resolved = SCHEMES[s.name].make_config(**{k: v for k, v in to_dict(s).items() if k != "name"})
        resolved.resolve(trained_length or t.seq_len, max(longest_length(cfg.eval), t.seq_len, t.random_positions or 0))
    except ValueError as err:
        raise ConfigError(f"scheme.{err}") from None
    with open_dict(s):
        for key, value in dataclasses.asdict(resolved).items():
            s[key] = value
    return cfg


def _curriculum(d: DictConfig) -> None:
    """Check the training data's needles (``data.passkey_*``) and copy windows (``data.copy_*``)."""
    for key in ("passkey_rate", "copy_rate"):
        if not 0 <= d[key] <= 1:
            raise ConfigError(f"data.{key}={d[key]} is not allowed: it is a fraction of training windows, between 0 and 1")
    _positive("data.passkey_pairs", d.passkey_pairs)
    if not 0 < d.copy_until <= 1:
        raise ConfigError(f"data.copy_until={d.copy_until} is not allowed: it is the fraction of train.steps at which "
                          "copy windows end, in (0, 1]")


def compile_default(setting: bool | None, device: str) -> bool:
    """``train.compile`` as a run on ``device`` (a checked ``train.device``: auto, cpu, cuda[:n]) uses it: the
    ``setting`` when given, else (None) True where the device is CUDA and False on the CPU."""
    return setting if setting is not None else resolve_device(device).type == "cuda"


def _dropouts(m: DictConfig) -> None:
    """Check ``model.dropout`` (residual and embedding) and ``model.attn_dropout`` (attention probabilities)."""
    for key in ("dropout", "attn_dropout"):
        if not 0 <= m[key] < 1:  # (NaN fails it too)
            raise ConfigError(f"model.{key}={m[key]} is not allowed: it is a dropout probability, 0 <= p < 1")


def _attention_scaling(m: DictConfig, seq_len: int) -> None:
    """Check ``model.attn_scale`` and fill log-n's ``model.scale_length`` (None → the train length ``seq_len``)."""
    if m.attn_scale not in ATTN_SCALES:
        raise ConfigError(f"model.attn_scale={m.attn_scale!r} is unknown; choose one of: {', '.join(ATTN_SCALES)}")
    if m.attn_scale != "log_n":
        if m.scale_length is not None:
            raise ConfigError(f"model.scale_length={m.scale_length} applies to model.attn_scale=log_n only "
                              f"(model.attn_scale={m.attn_scale}): drop it")
        return
    if m.scale_length is None:
        m.scale_length = seq_len
    if m.scale_length < 2:
        raise ConfigError(f"model.scale_length={m.scale_length} is not allowed: log-n scaling divides by ln L, "
                          "so L must be >= 2")


def to_dict(cfg: DictConfig) -> dict:
    """The resolved config as a plain dict (what results and checkpoints record)."""
    return OmegaConf.to_container(cfg, resolve=True)
