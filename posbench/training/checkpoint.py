"""Checkpoint files: write them atomically, read them back, keep a run folder's training states.

``checkpoint.pt`` in a run folder is the trained model: ``format`` (:data:`FORMAT`), weights, its model ``spec``
(posbench/model/build.py rebuilds the model from it), the resolved config (a plain dict), the vocabulary size and a
reference to the tokenizer (the data-cache folder and its key). ``posbench eval`` rebuilds the model from it
without retraining. Records of older formats are read as today's (posbench/config/upgrade.py).

``checkpoints/step-<n>.pt`` are training states (model, optimizer, step, RNG states, resolved config),
each with a SHA-256 checksum in ``step-<n>.pt.sha256``; the newest K are kept. Every file is written
atomically (temporary file, fsync, rename), so a failed write leaves the previous one intact.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from posbench.config.checks import ConfigError
from posbench.config.upgrade import model_section, scheme_section, upgrade
from posbench.data.corpora import file_sha256

FORMAT = 3  # 3: a scheme records its own options only, and the spec; 2: model.scale_embeddings; 1 and 2 are still read
READABLE = (1, 2, 3)
NAME = "checkpoint.pt"
STATES = "checkpoints"
log = logging.getLogger("posbench")


class CheckpointError(OSError):
    """The run folder cannot take a checkpoint (not writable, no room, a failed write)."""


def save(path: Path, model: torch.nn.Module, spec: dict, config: dict, tokenizer: dict, step: int, **extra) -> None:
    """Write a checkpoint atomically: to a temporary file, fsync, then rename over ``path``. It records the model's
    ``spec`` (posbench/model/build.py) beside ``config`` (the run's resolved config, a plain dict) and the vocabulary size.

    ``extra`` holds further plain values to keep (e.g. ``train_tokens``). Raises CheckpointError when the write
    fails."""
    state = {"format": FORMAT, "model": model.state_dict(), "spec": spec, "config": config,
             "vocab_size": spec["vocab_size"], "tokenizer": tokenizer, "step": step, **extra}
    _atomic_save(path, state)


def _atomic_save(path: Path, state: dict, checksum: bool = False) -> str:
    """torch.save to ``path`` via a temporary file, fsync and rename; return the file's SHA-256. ``checksum``: write
    it to ``<path>.sha256`` first, so that an interruption at any point (a second Ctrl-C, kill -9) leaves either
    the new file with its checksum or no new file, never a file that reads as corrupt.

    Raises CheckpointError when the write fails (the previous file at ``path`` is left as it was)."""
    tmp, checked = path.with_name(path.name + ".tmp"), False
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        digest = file_sha256(tmp)
        if checksum:
            side = path.with_name(path.name + ".sha256.tmp")
            side.write_text(digest + "\n")
            os.replace(side, path.with_name(path.name + ".sha256"))
            checked = True
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not write checkpoint {str(path)!r}: {e.strerror or e}") from None
    except BaseException:  # a second Ctrl-C mid-write: the half-written file does not stay behind; a whole one
        if checked and tmp.exists():  # whose checksum is already in place becomes the file, or the checksum would lie
            os.replace(tmp, path)
        tmp.unlink(missing_ok=True)
        path.with_name(path.name + ".sha256.tmp").unlink(missing_ok=True)
        raise
    return digest


def saved_steps(run_dir: Path) -> list[int]:
    """The steps of the training states in ``run_dir/checkpoints`` (their file names; not checked), oldest first."""
    return sorted(int(p.stem.removeprefix("step-")) for p in (Path(run_dir) / STATES).glob("step-*.pt"))


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
    _atomic_save(path, state, checksum=True)
    for old in sorted(folder.glob("step-*.pt"))[:-keep]:
        old.unlink()
        old.with_name(old.name + ".sha256").unlink(missing_ok=True)
    return path


def latest_state(run_dir: Path) -> dict | None:
    """The newest training state in ``run_dir/checkpoints`` whose checksum matches, or None when there is none.

    A corrupt or truncated state (checksum mismatch, missing checksum, unreadable) is reported as a warning and
    the previous one is tried. Its config is read through ``posbench.config.upgrade.upgrade`` (absent keys at their
    defaults, posbench/config/upgrade.py).

    Raises:
        ConfigError: states exist and none of them is usable (the message names the newest and offers
            ``resume=never``): training from step 0 would overwrite a run that is only damaged; or the state's
            config does not fit this posbench's schema.
    """
    paths, skipped = sorted((Path(run_dir) / STATES).glob("step-*.pt"), reverse=True), []
    for path in paths:
        recorded = path.with_name(path.name + ".sha256")
        if not recorded.exists() or recorded.read_text().strip() != file_sha256(path):
            skipped.append(f"{path} is corrupt or truncated (checksum mismatch)")
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file falls back the same way
            skipped.append(f"{path} is unreadable ({type(e).__name__})")
            continue
        for problem in skipped:
            log.warning("checkpoint %s: trying the previous one", problem)
        state["config"] = upgrade(state["config"], state.get("format", 1))  # a foreign config: ConfigError
        return state
    if paths:
        raise ConfigError(f"no usable training state in {Path(run_dir) / STATES}: {skipped[0]}; rather than train "
                          "over this run from step 0, posbench stops: pass resume=never to start over here (it "
                          "removes the old states), or use a new run folder")
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
        ConfigError (a ValueError): its config does not fit this posbench's schema.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}")
    try:
        state = torch.load(path, map_location=device, weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a damaged or foreign file
        raise ValueError(f"{str(path)!r} is not a readable posbench checkpoint ({type(e).__name__})") from None
    if not isinstance(state, dict) or state.get("format") not in READABLE:
        found = state.get("format") if isinstance(state, dict) else None
        raise ValueError(f"checkpoint {str(path)!r} has format {found!r}; this posbench reads formats "
                         f"{', '.join(map(str, READABLE))} (a checkpoint from a newer or unknown posbench)")
    state["config"] = upgrade(state["config"], state["format"])
    if state.get("spec"):
        state["spec"]["scheme"] = scheme_section(state["spec"]["scheme"], state["format"])
        state["spec"]["model"] = model_section(state["spec"].get("model", {}))
    return state
