"""A run started from another run's weights (``init_from``): the parent read, what the new run takes from it, the
new run checked against it, its weights loaded, and the lineage the new run records.

    posbench train init_from=outputs/…/rope scheme.scaling=yarn scheme.factor=4 train.seq_len=512 train.steps=200 \
        train.schedule=constant train.weight_decay=0

The new run's model starts from the parent's weights; its optimizer, schedule and step count start fresh. It takes
the parent's scheme, with the parent's options, the parent's train length L and its layers (a hybrid model's
pattern, window, global scheme, QK-norm and sinks), unless the command line or a preset gives them
(:func:`inherited`: posbench/jobs/command.py puts it into Hydra's composition), and the parent's evaluation lengths when
none are given and they fit the new run (:func:`inherit`: the report puts the run beside its parent, in the table of
those lengths); its other ``train.*`` and ``eval.*`` options are its own, and the options that differ from the
parent's are logged when it starts
(:func:`differences`). The rules (docs/design.md §5.6), each checked by :func:`check_config` and :func:`check`
before anything is written:

* every weight outside the scheme fits exactly: the same ``model.*`` sizes (dropout and attention dropout may
  differ), vocabulary and tokenizer (the tokenizer file's SHA-256);
* the scheme keeps its name, and its options are the parent's except those its class lists as
  ``fine_tune_options`` (RoPE's ``base``, ``scaling``, ``factor``, ``original_length``, YaRN's ramp, Llama 3's two
  factors; the learned
  table's size, which may grow: ``init_rows``); or it changes as :data:`SCHEME_CHANGES` allows: RoPE → NoPE,
  positions dropped after pretraining and recalibrated ("DroPE", 2025);
* a scheme given by name (``scheme=<the parent's>``) starts from its defaults: options left unset (None) take the
  parent's resolved values (a learned table keeps its size), and derived ones are filled from the parent's L
  (RoPE's ``original_length``: the length a scaling method scales from).

:func:`load` runs the same code on the real model that :func:`check` ran on the meta device.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, open_dict

from posbench.config.checks import ConfigError
from posbench.config.eval_checks import eval_values
from posbench.config.schema import LAYER_KEYS, scheme_schema, to_dict
from posbench.config.upgrade import model_section, upgrade
from posbench.data.corpora import file_sha256
from posbench.evaluation.results import run_label
from posbench.model import build, pretrained
from posbench.model.build import MODEL_KEYS
from posbench.schemes import SCHEMES
from posbench.training import checkpoint

SCHEME_CHANGES = {("rope", "nope")}  # (parent, new) scheme pairs a fine-tune may make: DroPE drops RoPE's positions
FREE_MODEL_KEYS = ("dropout", "attn_dropout")  # model.* a fine-tune may change: no weight depends on them
EXTENSION_OPTIONS = ("scaling", "factor", "base")  # scheme.* whose change extends the parent past its L


def config_sha256(config: dict) -> str:
    """A run's config hash, as a fine-tune's lineage records its parent's: SHA-256 of the config as sorted JSON."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Parent:
    """The run a new run starts from: its checkpoint file and contents (``posbench.training.checkpoint.read``, memory-mapped)."""

    path: Path
    state: dict

    @property
    def spec(self) -> dict:
        """The parent's model spec (posbench/model/build.py)."""
        return self.state.get("spec") or build.model_spec(self.state["config"], self.state["vocab_size"])

    @property
    def scheme(self) -> dict:
        return self.spec["scheme"]

    @property
    def pretrained(self) -> dict | None:
        """What the parent is when it is a pretrained checkpoint (``posbench.model.pretrained.as_run``'s info: name,
        source, family, L, quantisation, the weights' sha256); None for a posbench run."""
        return self.state.get("pretrained")

    @property
    def length(self) -> int:
        """The parent's train length L: the positions its weights were trained at."""
        return self.state["config"]["train"]["seq_len"]

    def lineage(self, rows: str) -> dict:
        """What the new run records of its parent: folder, checkpoint, step, config hash (SHA-256 of the config as
        sorted JSON), train tokens (its own and, with its ancestors', the total), label, scheme, L, and the L of the
        first run of the line (``origin_length``: the length a report compares every run of the line at)."""
        config, own, checkpoint_of = self.state["config"], self.state.get("train_tokens"), self.pretrained
        earlier = self.state.get("lineage") or {}
        out = {"folder": str(self.path.parent), "checkpoint": str(self.path), "step": self.state.get("step"),
               "config_sha256": config_sha256(config),
               "train_tokens": own, "total_train_tokens": self.state.get("total_train_tokens", own),
               "label": run_label(config, earlier or None), "scheme": self.scheme["name"],
               "train_length": self.length, "origin_length": earlier.get("origin_length", self.length),
               "init_rows": rows}
        if checkpoint_of:  # a pretrained checkpoint: its source for folder and file, its name for label
            out.update(folder=checkpoint_of["source"], checkpoint=checkpoint_of["source"], label=checkpoint_of["name"],
                       pretrained={k: checkpoint_of.get(k) for k in ("name", "source", "family", "sha256", "quantisation")})
        return out


def read(init_from: str) -> Parent:
    """The parent ``init_from`` names: a run folder holding ``checkpoint.pt``, or a checkpoint file; or a pretrained
    checkpoint (``posbench.model.pretrained.is_checkpoint``: a Hugging Face model folder, a Hub id in the local cache,
    a .gguf file), read as the run that would have recorded it (:func:`_pretrained`).

    Raises ConfigError: no checkpoint there, or not a readable posbench or pretrained checkpoint (the message names
    the path)."""
    if pretrained.is_checkpoint(init_from):
        return _pretrained(init_from)
    path = Path(init_from).expanduser().resolve()
    path = path / checkpoint.NAME if path.is_dir() else path
    try:
        return Parent(path, checkpoint.read(path))
    except FileNotFoundError:
        raise ConfigError(f"init_from={init_from!r}: no {checkpoint.NAME} there; give a finished run's folder or its "
                          f"{checkpoint.NAME}") from None
    except ValueError as e:
        raise ConfigError(f"init_from={init_from!r}: {e}") from None


def _pretrained(source: str) -> Parent:
    """The pretrained checkpoint ``source`` as a parent: its state (``posbench.model.pretrained.as_run``) with the
    config a run of it would record (today's defaults but its model, scheme, L, tokenizer and vocabulary; 0 steps;
    evaluation lengths L/4 … 4L, as ``posbench eval pretrained=`` takes them) and that config's model spec."""
    try:
        config, state = pretrained.as_run(source)
    except pretrained.PretrainedError as e:
        raise ConfigError(str(e).replace(f"pretrained={source}", f"init_from={source}", 1)) from None
    L = config["train"]["seq_len"]
    config = upgrade({**config, "train": {**config["train"], "steps": 0}, "eval": {"lengths": [L // 4, L // 2, L, 2 * L, 4 * L]}})
    return Parent(Path(source), {**state, "config": config, "spec": build.model_spec(config, state["vocab_size"])})


def inherited(parent: Parent) -> dict:
    """What a run started from ``parent`` takes from it unless given: ``{"scheme": the parent's scheme options
    (its name included), "seq_len": its L, "model": its layers' options (:data:`LAYER_KEYS` it records)}``; from a
    pretrained checkpoint, every ``model`` option it records (its sizes and block too: they are not a posbench preset's),
    and, from a parent whose corpus a checkpoint's tokenizer tokenised, ``"data"``: ``tokenizer`` and ``vocab_size``.
    Raises ConfigError for a scheme no longer registered."""
    if parent.scheme["name"] not in SCHEMES:
        raise ConfigError(f"init_from={parent.path.parent}: its scheme {parent.scheme['name']!r} is not registered; "
                          f"the schemes: {', '.join(sorted(SCHEMES))}")
    fields = {f.name for f in dataclasses.fields(scheme_schema(parent.scheme["name"]))}
    kept = LAYER_KEYS if parent.pretrained is None else set(MODEL_KEYS) - set(FREE_MODEL_KEYS)
    model = {k: v for k, v in (parent.spec.get("model") or {}).items() if k in kept}
    if parent.pretrained:
        model["name"] = parent.pretrained["name"]
    data = parent.state["config"].get("data") or {}
    return {"scheme": {k: v for k, v in parent.scheme.items() if k in fields}, "seq_len": parent.length, "model": model,
            **({"data": {k: data[k] for k in ("tokenizer", "vocab_size")}} if data.get("tokenizer") else {})}


def differences(before: dict, after: dict, prefix: str = "") -> list[str]:
    """The options of the config ``after`` that differ from those of ``before``, as ``key: old → new``, in
    ``after``'s order. Left out: keys ``before`` lacks (a parent recorded before the option existed), ``init_from``,
    and the options of a probe ``after`` does not run (``eval.passkey.*`` without ``eval.probes=[passkey]``)."""
    out, idle = [], [p for p in ("passkey", "context") if p not in after.get("probes", [])] if prefix == "eval." else []
    for key, new in after.items():
        if key not in before or prefix + key == "init_from" or key in idle:
            continue
        old = before[key]
        if isinstance(new, dict) and isinstance(old, dict):
            out += differences(old, new, f"{prefix}{key}.")
        elif new != old:
            out.append(f"{prefix}{key}: {old} → {new}")
    return out


def full_section(section: dict | None) -> dict | None:
    """A scheme section ``{"name": ..., **options}`` with every option of the scheme's Config, those it lacks at their
    defaults (a section recorded before the scheme gained an option compares equal to today's); None as it is."""
    if section is None or section.get("name") not in SCHEMES:
        return section
    options = {k: v for k, v in section.items() if k != "name"}
    return {"name": section["name"], **dataclasses.asdict(SCHEMES[section["name"]].make_config(**options))}


def inherit(cfg: DictConfig, parent: Parent) -> None:
    """Fill what ``cfg`` left unset from the parent: ``eval.lengths`` (None) with the parent's evaluation lengths
    when they fit the new run (:func:`_fit`: a run fine-tuned at 512 from a run evaluated at 128 … 2048 is evaluated
    at 128 … 2048, beside its parent; otherwise None: L … 16L of its own L), and, when the scheme keeps its name, the
    options of ``cfg.scheme`` left unset (None) with the parent's resolved values (a learned table keeps the
    parent's ``max_positions``)."""
    lengths = parent.state["config"]["eval"].get("lengths")
    if cfg.eval.lengths is None and lengths and _fit(cfg, lengths):
        cfg.eval.lengths = list(lengths)
    if cfg.scheme.name != parent.scheme["name"]:
        return
    with open_dict(cfg.scheme):
        for key, value in parent.scheme.items():
            if key in cfg.scheme and cfg.scheme[key] is None:
                cfg.scheme[key] = value


def _fit(cfg: DictConfig, lengths: list[int]) -> bool:
    """Whether evaluation ``lengths`` taken from a parent serve the run ``cfg``: one of them is past its L (else the
    run would never be evaluated past L) and the run's evaluation settings accept them (the sliding stride, the
    context probe's stride: :func:`posbench.config.eval_checks.eval_values`, tried on a copy)."""
    e = copy.deepcopy(cfg.eval)
    with open_dict(e):
        e.lengths = list(lengths)
    try:
        eval_values(e, cfg.train.seq_len)
    except ConfigError:
        return False
    return max(lengths) > cfg.train.seq_len


def check_config(cfg: DictConfig, parent: Parent) -> None:
    """Raise ConfigError unless the finished config ``cfg`` may start from ``parent``, by what the configs say
    (before any data is read): the scheme's name, the model's sizes, the tokenizer and vocabulary size, the scheme's
    options (only its ``fine_tune_options`` may differ from the parent's), and a train length no shorter than the
    parent's L where the run extends it (a scaling, a new RoPE base or PoSE: :data:`EXTENSION_OPTIONS`). Each message
    names the key and both values."""
    where = f"init_from={cfg.init_from}"
    old, new = parent.scheme["name"], cfg.scheme.name
    if old != new and (old, new) not in SCHEME_CHANGES:
        also = " or, after rope, give scheme=nope (DroPE: positions dropped)" if (old, "nope") in SCHEME_CHANGES else ""
        raise ConfigError(f"scheme={new} but {where} was trained with scheme={old}: the weights of one scheme do not "
                          f"load into another; drop scheme={new} (a fine-tune takes the parent's scheme and its "
                          f"options){also}")
    parent_model = model_section(parent.spec["model"])  # (keys it lacks at their defaults)
    for key in MODEL_KEYS:
        mine, theirs = cfg.model[key], parent_model[key]
        if key == "global_scheme":  # sections compared with every option, those either lacks at its defaults
            mine, theirs = (full_section(g) for g in (to_dict(cfg.model)[key], theirs))
        if key not in FREE_MODEL_KEYS and mine != theirs:
            why = ("a fine-tune keeps its parent's layers" if key in LAYER_KEYS else "the parent's weights would not fit")
            raise ConfigError(f"model.{key}={cfg.model[key]} but {where} has model.{key}={parent_model[key]}: {why}; "
                              f"give model.{key}={parent_model[key]}, or drop it")
    _check_data(cfg, parent.state["config"]["data"], where)
    if old != new:
        return
    allowed = SCHEMES[new].fine_tune_options
    changed = {k: (parent.scheme.get(k), v) for k, v in to_dict(cfg.scheme).items() if k != "name" and v != parent.scheme.get(k)}
    for key, (was, now) in changed.items():
        if key not in allowed:
            raise ConfigError(f"scheme.{key}={now} but {where} has scheme.{key}={was}: a fine-tune of {new} may change "
                              f"{', '.join(allowed) or 'none of its options'}; give scheme.{key}={was}")
    extension = [f"scheme.{k}={changed[k][1]}" for k in EXTENSION_OPTIONS if k in changed] + \
        [f"train.pose={cfg.train.pose}"] * bool(cfg.train.get("pose"))
    if extension and cfg.train.seq_len < parent.length:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} is shorter than the L={parent.length} of {where}, and "
                          f"{' '.join(extension)} extends it: an extension recipe fine-tunes at k·L, k >= 1; give "
                          f"train.seq_len >= {parent.length}")


def _check_data(cfg: DictConfig, theirs: dict, where: str) -> None:
    """Raise ConfigError unless the run tokenises as the parent did (its config's ``data`` section ``theirs``): the
    same ``data.tokenizer`` (None: a BPE of the corpus, checked once the data is prepared) and vocabulary size."""
    if cfg.data.get("tokenizer") != theirs.get("tokenizer"):
        raise ConfigError(f"data.tokenizer={cfg.data.get('tokenizer')} but {where} tokenises with "
                          f"data.tokenizer={theirs.get('tokenizer')}: its token ids would not match; drop data.tokenizer")
    if cfg.data.vocab_size != theirs["vocab_size"]:
        why = "its tokenizer has that many tokens" if theirs.get("tokenizer") else "the parent's embeddings would not fit"
        raise ConfigError(f"data.vocab_size={cfg.data.vocab_size} but {where} has data.vocab_size={theirs['vocab_size']}: "
                          f"{why}; drop data.vocab_size")


def check(cfg: DictConfig, parent: Parent, spec: dict, tokenizer_path: Path) -> None:
    """Raise ConfigError unless the run (finished config ``cfg``, model ``spec``, the tokenizer at
    ``tokenizer_path``) can start from ``parent``, once its data is prepared: the same tokenizer (the files' SHA-256;
    the data cache's key when the parent's tokenizer file is gone), and the parent's weights loaded into the model
    built on the meta device (:func:`load`), so that what passes here loads in training."""
    where = f"init_from={cfg.init_from}"
    if parent.pretrained:  # the corpus is tokenised by the checkpoint's own tokenizer (check_config: data.tokenizer)
        return _load_on_meta(cfg, parent, spec)
    recorded = parent.state.get("tokenizer") or {}
    theirs = Path(recorded.get("path") or "/nonexistent")
    mine, other = (file_sha256(tokenizer_path), file_sha256(theirs)) if theirs.is_file() else (
        tokenizer_path.parent.name.rsplit("-", 1)[-1], recorded.get("key"))
    if mine != other:
        raise ConfigError(f"data={cfg.data.name} gives the tokenizer {mine[:16]} but {where} was trained with the "
                          f"tokenizer {str(other)[:16]} (data={parent.state['config']['data']['name']}): its token ids "
                          "would not match")
    if spec["vocab_size"] != parent.state["vocab_size"]:
        raise ConfigError(f"the tokenizer has {spec['vocab_size']} tokens but {where} has {parent.state['vocab_size']}")
    _load_on_meta(cfg, parent, spec)


def _load_on_meta(cfg: DictConfig, parent: Parent, spec: dict) -> None:
    """Raise ConfigError unless the parent's weights load into the run's model (:func:`load`, on the meta device)."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build.build_model(spec)
    try:
        load(model, parent, cfg.init_rows, cfg.train.seq_len, device="meta")
    except ValueError as e:
        raise ConfigError(f"init_from={cfg.init_from}: {e}") from None


def load(model: torch.nn.Module, parent: Parent, rows: str, new_length: int, device="cpu") -> None:
    """Load the parent's weights into ``model`` (built from the new run's spec): every tensor outside the scheme
    exactly, the scheme's through its ``adopt`` (posbench/schemes/base.py), or none of them when the scheme changed
    (:data:`SCHEME_CHANGES`).

    Raises ValueError: a tensor that does not fit (the message names it and both shapes)."""
    trained = {k: v.to(device) for k, v in parent.state["model"].items()}
    own = {k: v for k, v in trained.items() if not k.startswith("scheme.")}
    try:
        result = model.load_state_dict(own, strict=False)
    except RuntimeError as e:  # a shape mismatch
        raise ValueError(str(e).splitlines()[-1].strip()) from None
    missing = [k for k in result.missing_keys if not k.startswith("scheme.")]
    if missing or result.unexpected_keys:
        raise ValueError(f"the parent's weights lack {missing} and have extra {result.unexpected_keys}")
    parts = [(prefix, s) for prefix, s in model.scheme_parts() if prefix.startswith("scheme.")]  # (global_scheme.*
    if type(parts[0][1]) is SCHEMES.get(parent.scheme["name"]):  # loaded exactly above, as a model's own weights)
        for prefix, scheme in parts:  # one, or one per layer (the parent's per_layer is the run's)
            scheme.adopt({k[len(prefix):]: v for k, v in trained.items() if k.startswith(prefix)}, rows,
                         parent.length, new_length)
    elif rows != "scheme":
        raise ValueError(f"init_rows={rows}: the scheme changed, so there is no parent table to interpolate")

