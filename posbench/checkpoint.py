"""Checkpoints: build the model a spec describes, save it with its config, load it back; resume state.

A model spec is a plain dict, ``{"vocab_size": int, "model": {...}, "scheme": {"name": ..., **options}}``:
everything :func:`build_model` needs, nothing else (:func:`model_spec` makes it from a run's config).
``checkpoint.pt`` in a run folder is the trained model: ``format`` (:data:`FORMAT`), weights, its
``spec``, the resolved config (a plain dict), the vocabulary size and a reference to the tokenizer (the
data-cache folder and its key). ``posbench eval`` rebuilds the model from it without retraining.

``checkpoints/step-<n>.pt`` are training states (model, optimizer, step, RNG states, resolved config),
each with a SHA-256 checksum in ``step-<n>.pt.sha256``; the newest K are kept. Every file is written
atomically (temporary file, fsync, rename), so a failed write leaves the previous one intact.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import torch

from posbench.config import DEFAULT_SCHEME, ModelConfig, upgrade
from posbench.corpora import file_sha256
from posbench.model import GPT
from posbench.positional import SCHEMES, build_scheme

FORMAT = 3  # 3: a scheme records its own options only, and the spec; 2: model.scale_embeddings; 1 and 2 are still read
READABLE = (1, 2, 3)
MODEL_KEYS = [f.name for f in dataclasses.fields(ModelConfig) if f.name != "name"]  # what a spec's "model" holds
NAME = "checkpoint.pt"
STATES = "checkpoints"
log = logging.getLogger("posbench")


class CheckpointError(OSError):
    """The run folder cannot take a checkpoint (not writable, no room, a failed write)."""


def model_spec(config: dict, vocab_size: int) -> dict:
    """The exact spec of the model a run's config describes: ``{"vocab_size", "model": {every key of
    ModelConfig but name (a preset's label, not part of the model)}, "scheme": {"name", every option of the
    scheme's Config, resolved}}``. ``config`` is a plain dict of today's format; keys it lacks read as their
    defaults (``posbench.config.upgrade``), and the scheme's ``resolve`` runs with the config's train length
    (for the learned scheme an unset ``max_positions`` becomes 16·L).

    Raises ConfigError (a ValueError) when ``config`` does not fit the schema, ValueError for a scheme
    option its ``resolve`` refuses.
    """
    config = upgrade(config, FORMAT)
    options = {k: v for k, v in config["scheme"].items() if k != "name"}
    scheme = SCHEMES[config["scheme"]["name"]].make_config(**options)
    seq_len = config["train"]["seq_len"]
    scheme.resolve(seq_len, seq_len)
    return {"vocab_size": vocab_size, "model": {k: config["model"][k] for k in MODEL_KEYS},
            "scheme": {"name": config["scheme"]["name"], **dataclasses.asdict(scheme)}}


def _merged(spec: dict, overrides: dict) -> dict:
    """``overrides`` merged over ``spec`` key by key (nested dicts recursively); a new ``scheme.name`` drops the
    old scheme's options."""
    out = dict(spec)
    for key, value in overrides.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            if key == "scheme" and value.get("name", old.get("name")) != old.get("name", DEFAULT_SCHEME):
                old = {}
            value = _merged(old, value)
        out[key] = value
    return out


def build_model(spec: dict, overrides: dict | None = None) -> GPT:
    """The GPT a model spec describes (see :func:`model_spec`), with ``overrides`` (a nested dict, e.g.
    ``{"scheme": {"name": "alibi"}, "model": {"n_layer": 2}}``) merged over it; an override that changes
    ``scheme.name`` drops the old scheme's options unless it gives them again. Keys the spec lacks read as
    today's defaults: ``ModelConfig``'s, ``scheme.name`` :data:`~posbench.config.DEFAULT_SCHEME`, the scheme's
    ``Config`` defaults (not resolved: the learned scheme needs ``max_positions``). ``model.name`` is ignored.

    The scheme's parameters are drawn from their own random stream, seeded by one number taken from torch's
    global generator, so that every other parameter is bit-identical whichever scheme (and whatever table
    size) is built after the same ``torch.manual_seed``: a comparison differs in positions only.

    Raises:
        KeyError: the spec has no ``vocab_size``.
        ValueError: a ``model`` key ModelConfig lacks, an unknown scheme or scheme option, or a value the
            scheme or the model refuses.
    """
    spec = _merged(spec, overrides or {})
    m = {**dataclasses.asdict(ModelConfig()), **spec.get("model", {})}
    m.pop("name")
    unknown = sorted(set(m) - set(MODEL_KEYS))
    if unknown:
        raise ValueError(f"model.{unknown[0]} is not a model option; the options: {', '.join(MODEL_KEYS)}")
    options = dict(spec.get("scheme") or {})
    name = options.pop("name", DEFAULT_SCHEME)
    scheme_seed = int(torch.randint(2**62, ()))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(scheme_seed)
        scheme = build_scheme(name, m["d_model"], m["n_head"], **options)
    return GPT(spec["vocab_size"], m["n_layer"], m["n_head"], m["d_model"], m["d_ff"], scheme, dropout=m["dropout"],
               scale_embeddings=m["scale_embeddings"])


def save(path: Path, model: torch.nn.Module, config: dict, vocab_size: int, tokenizer: dict, step: int, **extra) -> None:
    """Write a checkpoint atomically: to a temporary file, fsync, then rename over ``path``. It records the
    model's ``spec`` (:func:`model_spec` of ``config``) beside ``config``.

    ``extra`` holds further plain values to keep (e.g. ``train_tokens``). Raises CheckpointError when the
    write fails, ConfigError/ValueError when ``config`` describes no model (see :func:`model_spec`)."""
    state = {"format": FORMAT, "model": model.state_dict(), "spec": model_spec(config, vocab_size), "config": config,
             "vocab_size": vocab_size, "tokenizer": tokenizer, "step": step, **extra}
    _atomic_save(path, state)


def _atomic_save(path: Path, state: dict) -> str:
    """torch.save to ``path`` via a temporary file, fsync and rename; return the file's SHA-256.

    Raises CheckpointError when the write fails (the previous file at ``path`` is left as it was)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        digest = file_sha256(tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not write checkpoint {str(path)!r}: {e.strerror or e}") from None
    return digest


def check_room(folder: Path, nbytes: int) -> None:
    """Raise CheckpointError unless ``folder`` is writable and has room for two files of ``nbytes``."""
    folder.mkdir(parents=True, exist_ok=True)
    if not os.access(folder, os.W_OK):
        raise CheckpointError(f"{str(folder)!r} is not writable: checkpoints cannot be saved there")
    free = shutil.disk_usage(folder).free
    if free < 2 * nbytes:
        raise CheckpointError(f"{str(folder)!r} has {free / 2**20:.0f} MiB free; a checkpoint needs about "
                              f"{nbytes / 2**20:.0f} MiB (twice that while the previous one is kept)")


def save_state(run_dir: Path, state: dict, keep: int) -> Path:
    """Write ``checkpoints/step-<state['step']>.pt`` and its checksum; keep only the newest ``keep``."""
    folder = Path(run_dir) / STATES
    path = folder / f"step-{state['step']:08d}.pt"
    check_room(folder, sum(t.numel() * t.element_size() for t in _tensors(state)))
    digest = _atomic_save(path, state)
    tmp = path.with_name(path.name + ".sha256.tmp")
    tmp.write_text(digest + "\n")
    os.replace(tmp, path.with_name(path.name + ".sha256"))
    for old in sorted(folder.glob("step-*.pt"))[:-keep]:
        old.unlink()
        old.with_name(old.name + ".sha256").unlink(missing_ok=True)
    return path


def latest_state(run_dir: Path) -> dict | None:
    """The newest training state in ``run_dir/checkpoints`` whose checksum matches, or None.

    A corrupt or truncated state (checksum mismatch, missing checksum, unreadable) is reported as a
    warning and the previous one is tried. Its config is read through ``posbench.config.upgrade`` (absent
    keys at their defaults); one that does not fit this posbench's schema raises ConfigError."""
    for path in sorted((Path(run_dir) / STATES).glob("step-*.pt"), reverse=True):
        recorded = path.with_name(path.name + ".sha256")
        if not recorded.exists() or recorded.read_text().strip() != file_sha256(path):
            log.warning("checkpoint %s is corrupt or truncated (checksum mismatch): trying the previous one", path)
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file falls back the same way
            log.warning("checkpoint %s is unreadable (%s): trying the previous one", path, type(e).__name__)
            continue
        state["config"] = upgrade(state["config"], state.get("format", 1))  # a foreign config: ConfigError
        return state
    return None


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def read(path: Path, device="cpu") -> dict:
    """The checkpoint dict at ``path``, memory-mapped (weights are read only when used).

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: the file is not a readable posbench checkpoint, or its format is not in :data:`READABLE`.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}")
    try:
        state = torch.load(path, map_location=device, weights_only=True, mmap=True)
    except Exception as e:  # torch raises many kinds for a damaged or foreign file
        raise ValueError(f"{str(path)!r} is not a readable posbench checkpoint ({type(e).__name__})") from None
    if not isinstance(state, dict) or state.get("format") not in READABLE:
        found = state.get("format") if isinstance(state, dict) else None
        raise ValueError(f"checkpoint {str(path)!r} has format {found!r}; this posbench reads formats "
                         f"{', '.join(map(str, READABLE))} (a checkpoint from a newer or unknown posbench)")
    state["config"] = upgrade(state["config"], state["format"])
    return state


def model_from(state: dict, device="cpu", overrides: dict | None = None) -> GPT:
    """The trained model a checkpoint dict (from :func:`read`) describes, on ``device``, in eval mode: built from
    its ``spec`` (format 3), or from the spec of its (upgraded) config (formats 1 and 2), with ``overrides``
    merged over it as :func:`build_model` does (``posbench eval``'s ``{"scheme": {"scaling": "yarn", ...}}``).

    Raises RuntimeError when the weights do not fit the model (``load_state_dict``)."""
    spec = state.get("spec") or model_spec(state["config"], state["vocab_size"])
    model = build_model(spec, overrides).to(device)
    model.load_state_dict(state["model"])
    return model.eval()
