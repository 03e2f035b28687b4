"""A run started from another run's weights (``init_from``): the parent read, the new run checked against it, its
weights loaded, and the lineage the new run records.

    posbench train init_from=outputs/…/rope scheme.scaling=yarn scheme.factor=4 train.seq_len=512 train.steps=200 \
        train.schedule=constant train.weight_decay=0

The new run's model starts from the parent's weights; its optimizer, schedule and step count start fresh, and its
``train.*`` and scheme options are its own. The rules (docs/design.md §5.5), each checked by :func:`check` before
anything is written:

* every weight outside the scheme fits exactly: the same ``model.*`` sizes (dropout may differ), vocabulary and
  tokenizer (the data cache's key);
* the scheme keeps its name, with new options where its trained tensors still fit (RoPE's ``scaling``, ``factor``,
  ``original_length``; a learned table may grow: ``init_rows``), or changes as :data:`SCHEME_CHANGES` allows:
  RoPE → NoPE, positions dropped after pretraining and recalibrated ("DroPE", 2025);
* options left unset take the parent's resolved values, and derived ones are filled from the parent's L (RoPE's
  ``original_length``: the length a scaling method scales from).

:func:`load` runs the same code on the real model that :func:`check` ran on the meta device.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, open_dict

from posbench import build, checkpoint
from posbench.build import MODEL_KEYS
from posbench.config import ConfigError
from posbench.results import run_label
from posbench.schemes import SCHEMES

SCHEME_CHANGES = {("rope", "nope")}  # (parent, new) scheme pairs a fine-tune may make: DroPE drops RoPE's positions
FREE_MODEL_KEYS = ("dropout",)  # model.* a fine-tune may change: no weight depends on it


@dataclass(frozen=True)
class Parent:
    """The run a new run starts from: its checkpoint file and contents (``posbench.checkpoint.read``, memory-mapped)."""

    path: Path
    state: dict

    @property
    def spec(self) -> dict:
        """The parent's model spec (posbench/build.py)."""
        return self.state.get("spec") or build.model_spec(self.state["config"], self.state["vocab_size"])

    @property
    def scheme(self) -> dict:
        return self.spec["scheme"]

    @property
    def length(self) -> int:
        """The parent's train length L: the positions its weights were trained at."""
        return self.state["config"]["train"]["seq_len"]

    def lineage(self, rows: str) -> dict:
        """What the new run records of its parent: folder, checkpoint, step, config hash (SHA-256 of the config as
        sorted JSON), train tokens (its own and, with its ancestors', the total), label, scheme, L, and the L of the
        first run of the line (``origin_length``: the length a report compares every run of the line at)."""
        config, own = self.state["config"], self.state.get("train_tokens")
        earlier = self.state.get("lineage") or {}
        return {"folder": str(self.path.parent), "checkpoint": str(self.path), "step": self.state.get("step"),
                "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
                "train_tokens": own, "total_train_tokens": self.state.get("total_train_tokens", own),
                "label": run_label(config, earlier or None), "scheme": self.scheme["name"],
                "train_length": self.length, "origin_length": earlier.get("origin_length", self.length),
                "init_rows": rows}


def read(init_from: str) -> Parent:
    """The parent ``init_from`` names: a run folder holding ``checkpoint.pt``, or a checkpoint file.

    Raises ConfigError: no checkpoint there, or not a readable posbench checkpoint (the message names the path)."""
    path = Path(init_from).expanduser().resolve()
    path = path / checkpoint.NAME if path.is_dir() else path
    try:
        return Parent(path, checkpoint.read(path))
    except FileNotFoundError:
        raise ConfigError(f"init_from={init_from!r}: no {checkpoint.NAME} there; give a finished run's folder or its "
                          f"{checkpoint.NAME}") from None
    except ValueError as e:
        raise ConfigError(f"init_from={init_from!r}: {e}") from None


def inherit(cfg: DictConfig, parent: Parent) -> None:
    """Set the options of ``cfg.scheme`` left unset (None) to the parent's resolved values, when the scheme keeps
    its name (a learned table keeps the parent's ``max_positions``)."""
    if cfg.scheme.name != parent.scheme["name"]:
        return
    with open_dict(cfg.scheme):
        for key, value in parent.scheme.items():
            if key in cfg.scheme and cfg.scheme[key] is None:
                cfg.scheme[key] = value


def check(cfg: DictConfig, parent: Parent, spec: dict, tokenizer_key: str) -> None:
    """Raise ConfigError unless the run of finished config ``cfg`` (model ``spec``, tokenizer ``tokenizer_key``)
    can start from ``parent``: each message names the key and both values. The weights are loaded into the model
    built on the meta device (:func:`load`), so what passes here loads in training."""
    where = f"init_from={cfg.init_from}"
    old, new = parent.scheme["name"], spec["scheme"]["name"]
    if old != new and (old, new) not in SCHEME_CHANGES:
        raise ConfigError(f"scheme={new} but {where} was trained with scheme={old}: a fine-tune keeps the parent's "
                          "scheme (its options may change) or drops RoPE's positions (scheme=nope after rope)")
    parent_model = parent.spec["model"]
    for key in MODEL_KEYS:
        if key not in FREE_MODEL_KEYS and spec["model"][key] != parent_model[key]:
            raise ConfigError(f"model.{key}={spec['model'][key]} but {where} has model.{key}={parent_model[key]}: the "
                              "parent's weights would not fit")
    if spec["vocab_size"] != parent.state["vocab_size"]:
        raise ConfigError(f"data.vocab_size={spec['vocab_size']} but {where} has data.vocab_size="
                          f"{parent.state['vocab_size']}: the parent's embeddings would not fit")
    theirs = (parent.state.get("tokenizer") or {}).get("key")
    if theirs != tokenizer_key:
        raise ConfigError(f"data={cfg.data.name} has tokenizer {tokenizer_key} but {where} was trained with tokenizer "
                          f"{theirs} (data={parent.state['config']['data']['name']}): its token ids would not match")
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build.build_model(spec)
    try:
        load(model, parent, cfg.init_rows, cfg.train.seq_len, device="meta")
    except ValueError as e:
        changed = [f"scheme.{k}={v} (parent: {parent.scheme.get(k)})" for k, v in spec["scheme"].items()
                   if k != "name" and v != parent.scheme.get(k)]
        misfit = "shape" in str(e) and changed  # a tensor of another shape: the options that made it
        raise ConfigError(f"{where}: {e}" + (f"; changed: {', '.join(changed)}" if misfit else "")) from None


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
    if type(model.scheme) is SCHEMES.get(parent.scheme["name"]):
        model.scheme.adopt({k[len("scheme."):]: v for k, v in trained.items() if k.startswith("scheme.")}, rows,
                           parent.length, new_length)
    elif rows != "scheme":
        raise ValueError(f"init_rows={rows}: the scheme changed, so there is no parent table to interpolate")

