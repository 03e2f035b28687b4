"""Structured configs for posbench: the schema Hydra composes into, and the value checks.

The dataclasses below are registered in Hydra's ConfigStore as ``posbench_schema`` and are the first
entry of every defaults list in ``conf/``, so a misspelt key or a wrong type fails at composition time.
:func:`finalize` fills the derived defaults (evaluation lengths, the learned table size) and checks
values (:class:`ConfigError`) before any data is read or any step is trained.

Scheme, model and data code never see these objects: the CLI hands them plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, field, is_dataclass
from pathlib import Path
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

PROTOCOLS = ("nonoverlapping", "sliding")
SPLITS = ("validation", "test")


class ConfigError(ValueError):
    """A bad configuration value; the CLI prints its message as one line and exits with status 2."""


@dataclass
class SchemeConfig:
    name: str = "rope"
    base: float = 10000.0  # RoPE base θ; also the sinusoidal wavelength base (Vaswani et al. use 10000)
    max_positions: Optional[int] = None  # learned table rows; None = the largest evaluation length


@dataclass
class ModelConfig:
    name: str = "tiny"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int = 512
    dropout: float = 0.0


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


@dataclass
class TrainConfig:
    seq_len: int = 128  # the train length L, in tokens
    batch_size: int = 16  # sequences per step
    steps: int = 700
    lr: float = 2e-3
    min_lr: float = 2e-4  # end of the cosine decay
    warmup_steps: int = 40
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    device: str = "auto"  # auto | cpu | cuda
    threads: Optional[int] = None  # torch CPU threads; None = the cores this process may use
    log_every: int = 50
    checkpoint_every: int = 0  # steps between training checkpoints; 0 = only at the end
    keep_checkpoints: int = 2  # newest training checkpoints kept
    compile: bool = False  # torch.compile the model (no gain seen on CPU; falls back to eager on failure)


@dataclass
class EvalConfig:
    lengths: Optional[List[int]] = None  # None = L, 2L, 4L, 8L, 16L
    protocol: str = "nonoverlapping"
    stride: Optional[int] = None  # sliding-window stride S
    split: str = "validation"
    max_tokens: int = 16384  # budget: tokens scored per evaluation length
    batch_tokens: int = 16384  # tokens per forward pass


@dataclass
class WandbConfig:
    enabled: bool = True  # offline unless WANDB_MODE says otherwise; WANDB_MODE=disabled turns it off
    project: str = "posbench"
    entity: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class PosbenchConfig:
    scheme: SchemeConfig = field(default_factory=SchemeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    seed: int = 0
    resume: str = "auto"  # auto: continue from the run folder's newest valid checkpoint; never: start over


@dataclass
class EvalJob:
    """``posbench eval``: re-evaluate the checkpoint in ``run`` with these evaluation settings."""

    run: str = MISSING  # a run folder holding checkpoint.pt
    eval: EvalConfig = field(default_factory=EvalConfig)
    device: str = "auto"
    threads: Optional[int] = None


def register() -> None:
    """Store the schemas in Hydra's ConfigStore: ``posbench_schema`` (train), ``posbench_eval_schema`` (eval)."""
    ConfigStore.instance().store(name="posbench_schema", node=PosbenchConfig)
    ConfigStore.instance().store(name="posbench_eval_schema", node=EvalJob)


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} is not allowed: it must be a positive integer")


def _check_keys(node: DictConfig, schema, prefix: str = "") -> None:
    """Reject keys the schema lacks (Hydra's ``+key=value`` lifts struct mode, so composition alone lets them in)."""
    for key in node:
        if not hasattr(schema, key):
            raise ConfigError(f"unknown config key {prefix + key!r}; see the keys with: posbench train --cfg job")
        if is_dataclass(getattr(schema, key)):
            _check_keys(node[key], getattr(schema, key), f"{prefix}{key}.")


def finalize(cfg: DictConfig, schemes=()) -> DictConfig:
    """Fill derived defaults in place and check every value; return ``cfg``.

    Derived: ``eval.lengths`` (None → L·2^k for k = 0…4) and, for the learned scheme,
    ``scheme.max_positions`` (None → the largest evaluation length).

    Raises:
        ConfigError: a key the schema lacks, a non-positive length or size, an evaluation length < 2, an empty
            ``eval.lengths``, heads that do not divide the width, a learned table smaller than the
            largest evaluation length, an unknown scheme (``schemes`` lists the allowed names),
            protocol or split, or a stride outside 1…min(lengths).
    """
    _check_keys(cfg, PosbenchConfig())
    t, e, m, s = cfg.train, cfg.eval, cfg.model, cfg.scheme
    if schemes and s.name not in schemes:
        raise ConfigError(f"unknown scheme {s.name!r}; choose one of: {', '.join(sorted(schemes))}")
    for key in ("seq_len", "batch_size", "steps", "log_every"):
        _positive(f"train.{key}", t[key])
    for key in ("n_layer", "n_head", "d_model", "d_ff"):
        _positive(f"model.{key}", m[key])
    _positive("data.vocab_size", cfg.data.vocab_size)
    _positive("eval.max_tokens", e.max_tokens)
    _positive("eval.batch_tokens", e.batch_tokens)
    if m.d_model % m.n_head:
        raise ConfigError(f"model.n_head={m.n_head} does not divide model.d_model={m.d_model}")
    if (m.d_model // m.n_head) % 2:
        raise ConfigError(f"head dim d_model/n_head={m.d_model // m.n_head} must be even")
    if t.warmup_steps < 0 or t.lr <= 0 or t.min_lr < 0:
        raise ConfigError("train.lr must be > 0, train.min_lr and train.warmup_steps >= 0")
    if e.lengths is None:
        e.lengths = [t.seq_len * 2**k for k in range(5)]
    if len(e.lengths) == 0:
        raise ConfigError("eval.lengths=[] is empty: give at least one evaluation length >= 2")
    for n in e.lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ConfigError(f"evaluation length {n!r} in eval.lengths is not allowed: each must be an integer >= 2")
    if cfg.resume not in ("auto", "never"):
        raise ConfigError(f"resume={cfg.resume!r} is unknown; choose auto or never")
    if t.checkpoint_every < 0 or t.keep_checkpoints < 1:
        raise ConfigError("train.checkpoint_every must be >= 0 and train.keep_checkpoints >= 1")
    if e.protocol not in PROTOCOLS:
        raise ConfigError(f"eval.protocol={e.protocol!r} is unknown; choose one of: {', '.join(PROTOCOLS)}")
    if e.split not in SPLITS:
        raise ConfigError(f"eval.split={e.split!r} is unknown; choose one of: {', '.join(SPLITS)}")
    if e.protocol == "sliding":
        if e.stride is None:
            raise ConfigError("eval.protocol=sliding needs eval.stride (1 <= stride <= the evaluation length)")
        if e.stride < 1 or e.stride > min(e.lengths):
            raise ConfigError(
                f"eval.stride={e.stride} is not allowed: it must be between 1 and the smallest evaluation length {min(e.lengths)}"
            )
    if s.name == "learned":
        if s.max_positions is None:
            s.max_positions = max(max(e.lengths), t.seq_len)
        longest = max(max(e.lengths), t.seq_len)
        if s.max_positions < longest:
            raise ConfigError(
                f"scheme.max_positions={s.max_positions}: a learned table of {s.max_positions} rows cannot serve "
                f"length {longest}; use lengths <= {s.max_positions} or train with a larger scheme.max_positions"
            )
    return cfg


def eval_config(job: DictConfig, schemes=()) -> tuple[DictConfig, dict]:
    """``posbench eval``: the run's resolved config with ``job.eval`` in place of its evaluation settings.

    Returns (checked config, checkpoint dict). Raises ConfigError for a run folder without a readable
    checkpoint of a known format, and for evaluation settings the run cannot serve (see :func:`finalize`).
    """
    from posbench import checkpoint

    _check_keys(job, EvalJob())
    path = Path(job.run) / checkpoint.NAME
    try:
        state = checkpoint.read(path)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"run={job.run!r}: {e}") from None
    cfg = OmegaConf.merge(OmegaConf.structured(PosbenchConfig), state["config"])
    cfg.eval = job.eval
    return finalize(cfg, schemes), state


def to_dict(cfg: DictConfig) -> dict:
    """The resolved config as a plain dict (what results and checkpoints record)."""
    return OmegaConf.to_container(cfg, resolve=True)
