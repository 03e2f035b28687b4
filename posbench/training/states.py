"""A run folder's training states: which one a run may resume, and the manager that saves and restores them.

``posbench train`` in a folder that holds training states (``resume=auto``) continues the newest valid one:
:func:`resume_state` finds it and refuses a run it cannot honour (a changed config, ``train.steps`` or torchrun
world size). :class:`TrainingStates` is what the training loop calls: :meth:`~TrainingStates.start` restores a
state (with every rank's generator state) or starts over, :meth:`~TrainingStates.save` writes one,
:meth:`~TrainingStates.metrics` opens ``metrics.jsonl`` without the rows logged after the state. The rules are in
docs/design.md §5.4; the files are posbench/training/checkpoint.py's.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig

from posbench.config.checks import ConfigError
from posbench.config.schema import to_dict
from posbench.evaluation import results
from posbench.runtime import dist
from posbench.training import checkpoint

log = logging.getLogger("posbench")
RESUMABLE = ("train.log_every", "train.checkpoint_every", "train.keep_checkpoints", "train.threads", "train.sync_every",
             "train.device", "train.compile", "train.check_memory", "data.cache_dir", "eval.", "wandb.",
             "resume")  # keys a resumed run may change (train.compile: how the same model runs, as train.device)


NEEDLE_KEYS = ("eval.passkey.keys", "eval.passkey.key_vocab", "eval.passkey.key_length", "eval.passkey.marker",
               "eval.passkey.end")  # the needle format: training batches hold it when data.passkey_rate > 0


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved configs (plain dicts), excluding :data:`RESUMABLE`, but
    for :data:`NEEDLE_KEYS` when either config writes needles into its training batches (``data.passkey_rate`` > 0)."""
    needles = not prefix and any((c.get("data") or {}).get("passkey_rate") for c in (old, new))
    out = []
    for k in sorted(set(old) | set(new)):
        key, a, b = prefix + k, old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_keys(a, b, key + ".")
        elif a != b and not key.startswith(RESUMABLE):
            out.append(key)
    if needles:
        passkeys = [(c.get("eval") or {}).get("passkey") or {} for c in (old, new)]
        out += [k for k in NEEDLE_KEYS if passkeys[0].get(k.rsplit(".", 1)[1]) != passkeys[1].get(k.rsplit(".", 1)[1])]
    return out


def resume_state(cfg: DictConfig, out_dir: Path) -> dict | None:
    """The newest valid training state in ``out_dir`` when ``cfg.resume`` is auto, else None.

    Raises ConfigError when that state was trained with another config (other than :data:`RESUMABLE` keys),
    naming the changed keys. A changed ``train.steps`` is refused too, naming both numbers: the learning-rate
    schedule is a function of it, so a shorter or longer run is not the same run continued. So is a different
    number of processes (torchrun world size) than the state was trained by, naming both, unless
    ``cfg.resume_any_world_size`` is true."""
    state = checkpoint.latest_state(out_dir) if cfg.resume == "auto" else None
    if state is not None:
        changed = changed_keys(state["config"], to_dict(cfg))
        steps = state["config"]["train"]["steps"]
        if "train.steps" in changed:
            raise ConfigError(f"train.steps={cfg.train.steps} but {out_dir} holds a run of train.steps={steps} "
                              f"(checkpoint at step {state['step']}); its cosine schedule cannot be cut short or "
                              "extended: use a new run folder, or resume=never to start over here")
        if changed:
            raise ConfigError(f"{out_dir} holds a checkpoint of another config (changed: {', '.join(changed)}); "
                              "use a new run folder, or resume=never to start over here")
        sizes, world = world_sizes(state), dist.world()
        saved = sizes[-1][1] if sizes else None  # states written before it was recorded: unknown
        if saved is not None and saved != world and not cfg.resume_any_world_size:
            raise ConfigError(f"{out_dir} holds a checkpoint trained by {saved} processes (torchrun ranks) and this "
                              f"run has {world}: the global batch (train.batch_size × ranks), its contents and the "
                              f"effective learning rate would change mid-run; resume with {saved} processes, pass "
                              f"resume_any_world_size=true to go on with {world} (results.json records the change "
                              "as world_sizes), or resume=never to start over here")
    return state


def world_sizes(state: dict) -> list | None:
    """[[first step, processes], …] of the stretches that trained a state; None for states from before the
    number of processes was recorded (a state of the previous format records ``world_size`` alone)."""
    if state.get("world_sizes"):
        return state["world_sizes"]
    return [[0, state["world_size"]]] if state.get("world_size") else None


@dataclass
class Progress:
    """Where a run stands, besides its weights and optimizer: what a training state records of it."""

    step: int = 0  # optimizer steps done
    tokens: int = 0  # train tokens seen, all ranks
    seconds: float = 0.0  # training wall time before this process's stretch
    world_sizes: list = field(default_factory=list)  # [first step, processes] of each stretch, this one's included
    loss: float = math.nan  # the last synced step's loss (mean over ranks)
    resumed_from: int | None = None  # the step this process resumed from
    started: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        """Training wall time in seconds, every stretch of the run included."""
        return self.seconds + time.perf_counter() - self.started


class TrainingStates:
    """The training states of the run folder ``out_dir`` (``checkpoints/``), for the loop of one process.

    Args:
        out_dir: the run folder.
        config: the run's resolved config (a plain dict), recorded in every state.
        keep: newest states kept (``train.keep_checkpoints``).
        device: the training device (its generator state is saved and restored on CUDA).
        lineage: a run started from a parent's weights: its lineage (posbench/training/lineage.py), recorded in every state so
            that a resumed run reports the parent it started from, whatever has become of that parent since.
    """

    def __init__(self, out_dir: Path, config: dict, keep: int, device: torch.device, lineage: dict | None = None):
        self.out_dir, self.config, self.keep, self.device, self.lineage = Path(out_dir), config, keep, device, lineage

    def start(self, state: dict | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              fresh: bool) -> Progress:
        """Load ``state`` (from :func:`resume_state`) into ``model``, ``optimizer`` and this rank's generators, or,
        with none, start at step 0; ``fresh`` (``resume=never``) first removes the folder's old states (rank 0), so
        that they never outrank the new ones, and sets the old model's outputs aside (:func:`set_aside`). A rank the
        state has no generator state for (states from before
        per-rank streams hold rank 0's only; a larger world size) keeps the stream it has."""
        if fresh and dist.rank() == 0:
            for old in (self.out_dir / checkpoint.STATES).glob("step-*"):
                old.unlink()
            set_aside(self.out_dir)
        if state is None:
            return Progress(world_sizes=[[0, dist.world()]])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        by_rank = state.get("rng_by_rank") or [state["rng"]]
        if dist.rank() < len(by_rank):
            set_rng_state(by_rank[dist.rank()], self.device)
        sizes = world_sizes(state) or [[0, dist.world()]]
        if sizes[-1][1] != dist.world():  # allowed by resume_any_world_size=true
            sizes = [*sizes, [state["step"], dist.world()]]
        return Progress(state["step"], state["train_tokens"], state["train_seconds"], sizes,
                        state.get("loss", math.nan), resumed_from=state["step"])

    def check_room(self, model: torch.nn.Module) -> None:
        """Raise CheckpointError unless the folder can take a state of ``model`` and its optimizer (rank 0 checks;
        its error reaches every rank)."""
        nbytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
        dist.main_only(lambda: checkpoint.check_room(self.out_dir / checkpoint.STATES, nbytes))

    def save(self, progress: Progress, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Write the state at ``progress.step`` (every rank's generator state gathered; rank 0 writes)."""
        rngs = dist.gather(rng_state(self.device))
        dist.main_only(lambda: checkpoint.save_state(self.out_dir, {
            "format": checkpoint.FORMAT, "step": progress.step, "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "rng_by_rank": rngs, "train_tokens": progress.tokens,
            "train_seconds": progress.elapsed(), "loss": progress.loss, "world_sizes": progress.world_sizes,
            "config": self.config, **({"lineage": self.lineage} if self.lineage else {})}, self.keep))

    @contextmanager
    def metrics(self, step0: int):
        """``metrics.jsonl`` opened for appending on rank 0 (None elsewhere), with rows past ``step0`` (from before a
        crash) dropped; and the last step it held, whose metrics a killed run already sent to wandb (0 when none)."""
        f, last = metrics_file(self.out_dir, step0) if dist.rank() == 0 else (None, 0)
        try:
            yield f, last
        finally:
            if f:
                f.close()


OUTPUTS = ("results.json", "results.csv", "checkpoint.pt", "eval-*", "report.md", "report.csv", "*.png")  # a model's


def set_aside(out_dir: Path) -> Path | None:
    """Move the outputs of the model a run folder held (its results, re-evaluations, checkpoint, report and plots:
    :data:`OUTPUTS`) into ``superseded/<date>_<time>/`` there, so that a run started over (``resume=never``) is never
    reported beside another model's numbers (reports skip ``superseded/`` unless it is named).
    Returns that folder, or None when there was nothing to move."""
    found = sorted({p for pattern in OUTPUTS for p in Path(out_dir).glob(pattern) if p.is_file()})
    if not found:
        return None
    aside = Path(out_dir) / results.SUPERSEDED / time.strftime("%Y-%m-%d_%H-%M-%S")
    aside.mkdir(parents=True, exist_ok=True)
    for path in found:
        path.rename(aside / path.name)
    log.warning("resume=never: the previous model's %s moved to %s", ", ".join(p.name for p in found), aside)
    return aside


def metrics_file(out_dir: Path, step0: int):
    """``metrics.jsonl`` opened for appending, with rows past ``step0`` (from before a crash) dropped; and the
    last step whose loss it held (0 when none)."""
    path, last = Path(out_dir) / "metrics.jsonl", 0
    if path.exists():
        keep = []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                step = row["step"]
            except (json.JSONDecodeError, KeyError, TypeError):
                break  # a torn last row (power loss, full disk): it and anything after it go
            if "loss" in row:  # (a probe row, eval.probe_every, may be written before its window's loss rows)
                last = max(last, step)
            if step <= step0:
                keep.append(line)
        path.write_text("".join(line + "\n" for line in keep))
    return open(path, "a", buffering=1), last


def rng_state(device: torch.device) -> dict:
    """This process's torch generator states: ``torch`` (CPU) and ``cuda`` (None off CUDA), as ByteTensors."""
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(rng: dict, device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(rng["torch"])
    if device.type == "cuda" and rng.get("cuda") is not None:
        torch.cuda.set_rng_state(rng["cuda"], device)


def probe_curve(run_dir) -> list[dict]:
    """The probe rows of a run's ``metrics.jsonl`` (``posbench.training.loop.Loop.probe``), in step order: [{"step", "tokens",
    "accuracy": {T: accuracy}, "transfer": {T: the transfer control's accuracy} ({} without one)}]; [] when the run
    did not probe during training."""
    path, rows = run_dir / "metrics.jsonl", {}
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        acc = {int(k[8:]): v for k, v in row.items() if k.startswith("passkey@")}
        if acc:
            rows[row["step"]] = {"step": row["step"], "tokens": row["tokens"], "accuracy": acc,
                                 "transfer": {int(k[9:]): v for k, v in row.items() if k.startswith("transfer@")}}
    return [rows[k] for k in sorted(rows)]
