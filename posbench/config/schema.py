"""The configuration's schema and :func:`finalize`: what Hydra composes into, and what makes it a finished config.

The dataclasses below are the structured configs of ``posbench train`` (:class:`PosbenchConfig`) and ``posbench
eval`` (:func:`eval_schema`), stored in Hydra's ConfigStore by posbench/cli.py; a misspelt key or a wrong type fails at
composition. The ``scheme`` node takes one schema per registered scheme, made from its ``Config`` by
:func:`scheme_schema`: ``scheme=rope scheme.max_positions=64`` fails at composition. :func:`finalize` fills the
derived defaults (evaluation lengths, the scheme's ``Config.resolve``) and checks every value (:class:`ConfigError`)
before any data is read or any step is trained, with posbench/config/checks.py's checkers: a closed choice is
declared once, on its field (``choices(...)``: field metadata), and checked with every other in one loop.

Scheme, model and data code never see these objects: the jobs hand them plain values.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from posbench.attention import remap as remapping
from posbench.attention.dispatch import QK_NORM_LAYERS, QK_NORMS
from posbench.attention.temperature import ATTN_SCALES, BETA, SCALE_LAYERS
from posbench.attention.windows import WINDOW_KINDS
from posbench.config import checks, eval_checks, model_checks, resolvers  # noqa: F401  (resolvers: conf/'s ${posbench_*:})
from posbench.config.checks import ConfigError, check_choices, check_keys, choices, longest_length
from posbench.evaluation import context, passkey
from posbench.schemes import SCHEMES

PROTOCOLS = ("nonoverlapping", "sliding")  # eval.protocol: posbench/evaluation/perplexity.py
INIT_ROWS = ("scheme", "interpolate")  # init_rows: posbench/training/lineage.py
SPLITS = ("validation", "test")
SCHEDULES = ("cosine", "constant")  # train.schedule: posbench/training/loop.py lr_factor
PRECISIONS = ("auto", "fp32", "bf16")  # train.precision: posbench.runtime.device.autocast_dtype
PROBES = ("passkey", "context")  # eval.probes
RESUMES = ("auto", "never")  # resume: auto continues from the run folder's newest valid checkpoint; never starts over
DEFAULT_SCHEME = "rope"  # a recorded config without scheme.name (train.yaml's default, the old schema's too)
BLOCKS = ("gpt", "llama")  # model.block: posbench/model/blocks.py


@dataclass
class ModelConfig:
    name: str = "tiny"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int = 512
    dropout: float = 0.0  # residual and embedding dropout, 0 <= p < 1
    attn_dropout: float = 0.0  # attention-probability dropout, 0 <= p < 1 (any > 0 moves bias schemes off Flex on CUDA)
    scale_embeddings: Optional[bool] = None  # token embeddings × sqrt(D) for every scheme; None = the block's: gpt yes, llama no
    attn_scale: str = choices(*ATTN_SCALES, default="none")  # queries × a factor of their index (attention/temperature.py)
    scale_length: Optional[int] = None  # L of log_n, log_n_clipped; F of floor_log(_n); None = L (floor_log_n: L + 1)
    scale_beta: float = BETA  # β of floor_log and floor_log_n
    scale_layers: str = choices(*SCALE_LAYERS)  # all | global (the G layers: Llama 4's NoPE layers); zero-shot only
    # hybrid layers (model/gpt.py's GPT, attention/windows.py): L local, G global, repeated over the layers; G = every layer
    layer_pattern: str = "G"
    global_scheme: Any = None  # the G layers' scheme: a name or {name: …, <option>: …}; None = the run's scheme
    window: Optional[int] = None  # the L layers' attention window W (tokens); None = every earlier key
    window_kind: str = choices(*WINDOW_KINDS)  # sliding (0 <= i − j < W) | chunked (the same chunk of W tokens)
    qk_norm: str = choices(*QK_NORMS)  # none | rms: RMSNorm of each head's query and key before the rotation
    qk_norm_layers: str = choices(*QK_NORM_LAYERS)  # all | local (the L layers: Llama 4's RoPE layers)
    qk_norm_weight: bool = True  # a learned gain per head dimension (Gemma 3, EXAONE 4); false: none (Llama 4)
    attn_sink: bool = False  # a learned logit per head and layer in every softmax's denominator (GPT-OSS)
    # the block (model/blocks.py): gpt (GPT-2's pre-LayerNorm, GELU MLP) | llama (pre-RMSNorm, SwiGLU, no biases)
    block: str = choices(*BLOCKS)
    n_kv_head: Optional[int] = None  # key/value heads, grouped-query attention; None = n_head
    head_dim: Optional[int] = None  # a head's width; None = d_model / n_head
    tie_head: bool = True  # the head shares the token embeddings' weights
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen 2)
    norm_eps: float = 1e-5  # the blocks' LayerNorm or RMSNorm epsilon


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
    tokenizer: Optional[str] = None  # a pretrained checkpoint's tokenizer (init_from=<checkpoint> sets it); None: own BPE
    passkey_rate: float = 0.0  # fraction of training windows given needle + query pairs (data/needles.py); 0 = none
    passkey_pairs: int = 1  # needle + query pairs per needled window, each its own key (several: log-uniform distances)
    copy_rate: float = 0.0  # fraction of training windows made [span, separator, same span] at step 0; 0 = none
    copy_until: float = 0.5  # the copy rate falls linearly to 0 at this fraction of train.steps


@dataclass
class TrainConfig:
    seq_len: int = 128  # the train length L, in tokens
    batch_size: int = 16  # sequences per step
    steps: int = 700
    lr: float = 2e-3
    min_lr: float = 2e-4  # end of the cosine decay
    warmup_steps: int = 40
    schedule: str = choices(*SCHEDULES)  # cosine (warmup, decay to min_lr) | constant (warmup, then lr: PI's fine-tuning)
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
    # training's autocast: auto = bf16 on CUDA, fp32 on CPU; bf16 also on a CPU with native bfloat16 (AVX512-BF16,
    # AMX); evaluation is fp32 whatever it says
    precision: str = choices(*PRECISIONS)
    random_positions: Optional[int] = None  # M: train on sorted random positions from [0, M) (Ruoss et al. 2023)
    pose: Optional[int] = None  # L_t: PoSE's target length, positions in chunks with random skips (Zhu et al. 2023)
    pose_chunks: int = 2  # PoSE's chunks N per training window (its paper's and code's 2)
    sync_every: Optional[int] = None  # steps between host syncs (NaN and stop checks, metrics); None = 1 on CPU, 16 on CUDA


@dataclass
class EvalConfig:
    lengths: Optional[List[int]] = None  # None = L, 2L, 4L, 8L, 16L
    protocol: str = choices(*PROTOCOLS)
    stride: Optional[int] = None  # sliding-window stride S
    split: str = choices(*SPLITS)
    max_tokens: Optional[int] = None  # budget: targets scored per evaluation length; None = the whole split
    batch_tokens: int = 16384  # tokens per forward pass
    probes: List[str] = choices(*PROBES, default_factory=list)  # beside perplexity: passkey, context
    probe_every: int = 0  # training steps between passkey probes at L and the longest probe length; 0 = none
    passkey: passkey.Config = field(default_factory=passkey.Config)  # the probe owns its options and their checks
    context: context.Config = field(default_factory=context.Config)  # context use past L (posbench/evaluation/context.py)
    remap: str = choices(*remapping.METHODS)  # training-free extension (posbench/attention/remap.py): posbench eval only
    remap_options: remapping.Options = field(default_factory=remapping.Options)  # its parameters; None = defaults


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
    resume: str = choices(*RESUMES)  # auto: continue from the run folder's newest valid checkpoint; never: start over
    resume_any_world_size: bool = False  # resume under another torchrun world size (recorded as world_sizes)
    init_from: Optional[str] = None  # start from this run's weights (its folder or checkpoint.pt): posbench/training/lineage.py
    init_rows: str = choices(*INIT_ROWS)  # rows a learned table gains from the parent: scheme (initialised) | PI


@dataclass
class EvalModelConfig:
    """The model options ``posbench eval`` may change, the zero-shot temperature's (posbench/attention/temperature.py); None:
    the run's own. The sizes and the block may be given only as the run's or the checkpoint's own."""
    attn_scale: Optional[str] = None  # none | floor_log | floor_log_n | log_n_clipped (1 within L)
    scale_length: Optional[int] = None
    scale_beta: Optional[float] = None
    scale_layers: Optional[str] = None
    block: Optional[str] = None
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_kv_head: Optional[int] = None
    d_model: Optional[int] = None
    d_ff: Optional[int] = None
    head_dim: Optional[int] = None


@dataclass
class EvalJobConfig:
    """``posbench eval``: evaluate the checkpoint in ``run``, or the ``pretrained`` one, with these settings."""

    run: Optional[str] = None  # a run folder holding checkpoint.pt
    pretrained: Optional[str] = None  # or a Hugging Face model folder, a Hub id or a .gguf file (posbench/model/pretrained.py)
    data: Optional[DataConfig] = None  # pretrained= only: the corpus (a conf/data/ option; None: data=shakespeare)
    eval: EvalConfig = field(default_factory=EvalConfig)
    device: str = "auto"
    threads: Optional[int] = None
    scheme: Any = None  # options of the run's scheme to change (scheme.scaling=yarn); the stored schema: eval_schema()
    model: EvalModelConfig = field(default_factory=EvalModelConfig)  # a zero-shot temperature (model.attn_scale=floor_log)


# ---- schemas made from the registry ------------------------------------------------------------------------

_MADE: dict[str, type] = {}  # the dataclasses made by schema(), by name


def schema(name: str, fields: list[tuple[str, Any, dataclasses.Field]], bases: tuple = ()) -> type:
    """The dataclass ``name`` with ``fields`` ((field name, type, ``dataclasses.field(...)``), in order) over
    ``bases``: made once per distinct definition, and findable as ``posbench.config.schema.<name>``, so that configs holding
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
    """The structured config of the scheme registered as ``name``: ``name: str = <name>``, then the fields of the
    scheme's ``Config`` (types and defaults); ``posbench.config.schema.scheme_<name>``. Raises KeyError if unknown."""
    return schema(f"scheme_{name}", [("name", str, field(default=name)), *_options(SCHEMES[name].Config)])


def eval_schema() -> type:
    """The structured config of ``posbench eval``: :class:`EvalJobConfig` whose ``scheme`` node takes every option of
    every registered scheme (Optional, default None: not given; an option two schemes type differently: Any), so
    that ``scheme.scaling=yarn`` composes and ``scheme.factor=abc`` or a key no scheme has fails at composition.
    Which of them the run's scheme has is checked by ``posbench.jobs.eval_job.prepare``."""
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


# ---- finalize -----------------------------------------------------------------------------------------


def finalize(cfg: DictConfig, training: bool = True, trained_length: int | None = None) -> DictConfig:
    """Fill derived defaults in place and check every value; return ``cfg``. Run once per job, by the job's
    ``prepare`` (posbench/jobs/train_job.py, posbench/jobs/eval_job.py), before any data is read or any step is trained.
    The checks are posbench/config/checks.py's and model_checks.py's, one per section, after the keys and the closed
    choices.

    Derived: ``eval.lengths`` (None → L·2^k for k = 0…4), when ``training`` ``train.compile`` (None → whether the
    run's device is CUDA), and the scheme's options: ``cfg.scheme`` is read into the scheme's ``Config``, whose
    ``resolve(L, longest)`` fills and checks them (the learned scheme's ``max_positions``: None → 16·L, never
    derived from ``eval.*``, so the model, its initialisation included, does not depend on how it will be
    evaluated), and the resolved values are written back into ``cfg.scheme``; so are a hybrid model's
    ``model.global_scheme`` (a name reads as ``{name: <name>}``) and its options. ``trained_length`` is the length the
    weights were trained at when that is not ``train.seq_len`` (a run started from a parent's weights,
    ``init_from``: the parent's L); derived scheme options are filled from it (RoPE's ``original_length``: the
    length a scaling method scales from), as is ``model.scale_length`` (log-n scaling's L). Logs a warning when
    ``train.random_positions`` (M) or ``train.pose`` (L_t) is below the longest evaluation length, and, when
    ``training``, when
    ``train.warmup_steps`` >= ``train.steps`` > 0 (the learning rate never reaches ``train.lr`` before the end).

    Raises:
        ConfigError: a key the schema lacks, a value outside its field's declared choices (``train.schedule``,
            ``eval.protocol``, ``eval.split``, ``eval.probes``, ``model.attn_scale``, ``resume``, ``init_rows``),
            an unknown scheme (the message lists the registered names), a non-positive length or size, an
            evaluation length < 2, an empty ``eval.lengths``, heads that do not divide the width, a scheme option
            the scheme lacks or its ``resolve`` refuses (the message starts ``scheme.<option>=<value>``, e.g. a
            learned table smaller than the longest length), ``model.dropout`` or ``model.attn_dropout`` outside
            [0, 1), a ``model.scale_length`` < 2 or given without ``log_n``, ``train.random_positions`` or
            ``train.pose`` below L or for a scheme that reads no positions, both of them, ``train.pose_chunks``
            outside 2…L or without ``train.pose``, hybrid layers that do not fit (``model_checks.layers``: a letter
            other than L and G, a window without an L layer, above L or without a size, a global scheme without a G
            or an L layer, of an unknown name or option, or embedding positions, options of ``model.qk_norm`` without
            it, a pattern whose L and G layers would not differ), a stride outside 1…min(lengths), ``train.steps=0`` without
            ``init_from`` (0 steps: a parent evaluated as it is), ``init_rows`` other than ``scheme`` without
            ``init_from``, optimizer values that would break training (lr ≤ 0, min_lr outside 0…lr,
            weight_decay < 0, grad_clip < 0, betas outside [0, 1)), or, when ``training`` (a training job, not a
            re-evaluation of a recorded config), ``train.device=cuda`` on a machine without CUDA.
    """
    check_keys(cfg, PosbenchConfig())
    check_choices(cfg, PosbenchConfig)
    checks.run_values(cfg)
    t, s = cfg.train, cfg.scheme
    checks.train_values(t, cfg.init_from, training)
    checks.data_values(cfg.data)
    if training:
        checks.training_data_inert(cfg.data, DataConfig())
    model_checks.model_values(cfg.model, trained_length or t.seq_len)
    eval_checks.eval_values(cfg.eval, t.seq_len, needles=training and cfg.data.passkey_rate > 0, training=training)
    eval_checks.remap_values(cfg.eval, cfg.model, s, t.seq_len, training)
    checks.training_positions(t, [s.name, *model_checks.global_name(cfg.model)], cfg.eval)
    longest = max(longest_length(cfg.eval), t.seq_len, t.random_positions or 0, t.pose or 0)  # positions seen
    try:
        resolved = SCHEMES[s.name].make_config(**{k: v for k, v in to_dict(s).items() if k != "name"})
        resolved.resolve(trained_length or t.seq_len, longest)
    except ValueError as err:
        raise ConfigError(f"scheme.{err}") from None
    with open_dict(s):
        for key, value in dataclasses.asdict(resolved).items():
            s[key] = value
    model_checks.layers(cfg.model, s.name, trained_length or t.seq_len, longest)
    return cfg


LAYER_KEYS = ("layer_pattern", "global_scheme", "window", "window_kind", "qk_norm", "qk_norm_layers", "qk_norm_weight",
              "attn_sink")  # model.*: a hybrid's layers (its label says them; a fine-tune takes them from its parent)
SAID_ELSEWHERE = {  # what the first log line of a run or its label already says, and what changes no step
    "train": {"seq_len", "steps", "batch_size", "device", "threads", "log_every", "checkpoint_every", "keep_checkpoints",
              "check_memory", "sync_every", "compile", "precision", "random_positions", "pose", "pose_chunks"},
    "data": {"name", "vocab_size", "cache_dir", "num_proc", "path", "validation", "test", "train_files", "validation_files",
             "test_files"},  # (the first line names the corpus's cache folder, name-key, and its vocabulary)
    "model": {"name", "n_layer", "n_head", "d_model", "d_ff", *LAYER_KEYS},
}


def training_options(cfg: DictConfig) -> list[str]:
    """``key=value`` for every option of a finalized ``cfg`` that changes training and is set away from the
    schema's default, where neither the run's label nor its first log line says it: the optimiser and schedule
    (``train.*``), the data and its curricula (``data.passkey_*``, ``data.copy_*``, ``data.max_train_tokens`` …), the model's
    regularisation and attention scale (``model.*``), probes during training (``eval.probe_every``) and a parent
    (``init_from``, ``init_rows``)."""
    out = []
    model = ModelConfig(scale_embeddings=model_checks.embeddings_scaled(cfg.model.block, None))  # the block's
    for section, defaults in (("train", TrainConfig()), ("data", DataConfig()), ("model", model)):
        for key, value in to_dict(cfg[section]).items():
            if key not in SAID_ELSEWHERE[section] and value != getattr(defaults, key):
                out.append(f"{section}.{key}={value}")
    out += [f"eval.probe_every={cfg.eval.probe_every}"] * bool(cfg.eval.probe_every)
    out += [f"{k}={cfg[k]}" for k in ("init_from", "init_rows") if cfg[k] != getattr(PosbenchConfig(), k)]
    return out


def to_dict(cfg: DictConfig) -> dict:
    """The resolved config as a plain dict (what results and checkpoints record)."""
    return OmegaConf.to_container(cfg, resolve=True)
