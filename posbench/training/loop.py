"""The training loop: fit a small causal LM at train length L, checkpoint it, evaluate it at L…16L.

``train(job)`` runs a prepared job (posbench/jobs/train_job.py) in its run folder: set up the process → build the model
from the job's spec → AdamW with linear warmup, then cosine decay or a constant rate (``train.schedule``) → the
training steps (:class:`Loop`) with training states (posbench/training/states.py) → perplexity at every evaluation
length → ``checkpoint.pt``, ``results.json``
and ``results.csv``. Batches are random crops of L + 1 tokens from the train memmap; batch i is a pure function of
(seed, i, rank), and the learning rate a pure function of the step, so a run resumed from a training state
(``resume=auto``, the default) sees the same batches and, on CPU with the same thread count, produces
bit-identical losses. Under torchrun the loop runs DDP; rank 0 alone writes. Per-step metrics go to
``metrics.jsonl`` (and wandb); a
non-finite loss or gradient stops the run, marked failed.
SIGTERM, SIGUSR2 or Ctrl-C saves a checkpoint at the end of the running step and exits (75 or 130:
posbench/runtime/signals.py); a re-run of the same command resumes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from posbench.config.schema import to_dict, training_options
from posbench.data import needles
from posbench.data.batches import copy_rate, get_batch, pose_positions, random_positions
from posbench.evaluation import context, passkey, results
from posbench.evaluation.perplexity import evaluate
from posbench.model import build
from posbench.runtime import dist
from posbench.runtime.device import autocast_dtype, flush_denormals_from_now, resolve_device, set_threads
from posbench.runtime.signals import EXIT_PREEMPTED, Interrupted, StopSignals, exit_status  # noqa: F401  (EXIT_PREEMPTED: the CLI's)
from posbench.runtime.tracking import Tracker
from posbench.training import checkpoint, lineage
from posbench.training.job import TrainJob
from posbench.training.optim import Forward, lr_factor, make_optimizer
from posbench.training.states import Progress, TrainingStates, probe_curve

log = logging.getLogger("posbench")


class TrainingFailed(RuntimeError):
    """A non-finite loss or gradient; the run is marked failed and its last good checkpoint kept."""


class Preempted(Exception):
    """SIGTERM, SIGUSR2 or SIGINT arrived and a checkpoint was saved. The CLI exits with ``exit_status``
    (75, or 130 for Ctrl-C: posbench/runtime/signals.py); ``signum``: the signal, ``saved``: what was saved where
    (the message without the single run's resume hint, which a sweep's job does not take)."""

    def __init__(self, saved: str, signum: int, run_dir):
        super().__init__(f"{saved}; to resume, run the same command with hydra.run.dir={run_dir}")
        self.saved, self.signum, self.exit_status = saved, signum, exit_status(signum)


@dataclass(frozen=True)
class Process:
    """This process's place in the run: its torchrun rank and world size, its device and CPU threads."""

    rank: int
    world: int
    device: torch.device
    threads: int


def train(job: TrainJob, tracker: Tracker | None = None, stop_file: Path | None = None) -> dict:
    """Train (or resume), checkpoint and evaluate the prepared ``job`` in its run folder ``job.run_dir``; return the
    results record. ``tracker`` (a :class:`posbench.runtime.tracking.Tracker`) receives train and eval metrics;
    ``stop_file``: a sweep's stop file (posbench/runtime/sweep_stop.py), read after every step as a stop signal.

    Raises:
        posbench.training.checkpoint.CheckpointError: the run folder cannot take a checkpoint.
        TrainingFailed: a non-finite loss or gradient (the step is in the message).
        Preempted: SIGTERM, SIGUSR2 or SIGINT (Ctrl-C) arrived and a checkpoint was saved (for SIGUSR2 a handler
            installed before, such as submitit's, is called first: it may requeue the job and exit instead).
        KeyboardInterrupt: a second Ctrl-C, while the first one's step was still running (no checkpoint).
    """
    cfg, t, out_dir = job.config, job.config.train, job.run_dir
    tracker, config = tracker or Tracker(False, out_dir, ""), to_dict(cfg)
    proc = start_process(t.device, t.threads, cfg.seed)
    model = build.build_model(job.spec).to(proc.device)
    if job.parent and job.state is None:  # a run started from a parent's weights (a resumed one takes its state's)
        lineage.load(model, job.parent, cfg.init_rows, t.seq_len, proc.device)
        step = job.lineage["step"]  # (None: a pretrained checkpoint)
        log.info("starting from the weights of %s (%s%s)", job.parent.path, job.lineage["label"],
                 "" if step is None else f", step {step}")
    dist.seed_rank(cfg.seed, proc.rank)  # the same weights on every rank; from here on, dropout masks of each rank's own
    optimizer = make_optimizer(model, t, fused=proc.device.type == "cuda")
    states = TrainingStates(out_dir, config, t.keep_checkpoints, proc.device, job.lineage)
    progress = states.start(job.state, model, optimizer, fresh=cfg.resume == "never")
    if progress.resumed_from is not None:
        log.info("resumed from the checkpoint at step %d in %s", progress.step, out_dir / checkpoint.STATES)
    elif (out_dir / "metrics.jsonl").exists() and cfg.resume == "auto":  # an earlier start stopped before a save
        log.warning("%s holds an earlier start of this run but no training state: training from step 0", out_dir)
    states.check_room(model)
    log.info("%s: %s params, L=%d, %d steps × %d sequences × %d ranks, device %s, %d threads, data %s (vocabulary %d)",
             job.label, f"{sum(p.numel() for p in model.parameters()):,}", t.seq_len, t.steps, t.batch_size, proc.world,
             proc.device, proc.threads, job.corpus.root, job.corpus.vocab_size)
    dtype = autocast_dtype(t.precision, proc.device)
    log.info("on: %s training%s", "bf16 autocast" if dtype else "fp32", "".join(f", {o}" for o in training_options(cfg)))
    with StopSignals(stop_file=stop_file) as stop:
        try:
            if Loop(job, model, optimizer, states, proc, tracker).run(progress, stop):  # a stop signal reached a rank
                states.save(progress, model, optimizer)
                hand_off(stop, progress.step, out_dir)
        except KeyboardInterrupt:  # the second Ctrl-C: no checkpoint; the CLI says what a rerun resumes from
            raise Interrupted(out_dir, (checkpoint.saved_steps(out_dir) or [None])[-1], cfg.resume) from None
    wall = progress.elapsed()
    if (progress.resumed_from or 0) < t.steps:
        states.save(progress, model, optimizer)
    digests = dist.gather(_param_digest(model))
    if len(set(digests)) > 1:
        raise TrainingFailed(f"parameters differ across ranks after training: {digests}")
    rows, extra = evaluate_run(job, model, proc, tracker)
    record = run_record(job, config, rows, extra, progress, wall, proc, digests)
    dist.main_only(lambda: write_outputs(job, model, config, record, tracker))
    return record


def hand_off(stop: StopSignals, step: int, out_dir) -> None:
    """After a stop signal's checkpoint at ``step``: call a SIGUSR2 handler installed before ours (submitit's, which
    requeues the SLURM task and exits), then raise :class:`Preempted` with the exit status of the signal (another
    rank's signal counts as SIGTERM)."""
    signum, frame = stop.received[0] if stop.received else (signal.SIGTERM, None)
    if signum == signal.SIGUSR2 and callable(stop.previous[signum]):
        stop.previous[signum](signum, frame)
    raise Preempted(f"{signal.Signals(signum).name} at step {step}: checkpoint saved in {out_dir / checkpoint.STATES}",
                    signum, out_dir)


def evaluate_run(job: TrainJob, model: torch.nn.Module, proc: Process, tracker: Tracker) -> tuple[list[dict], dict]:
    """Perplexity at every evaluation length (posbench/evaluation/perplexity.py) and the probes the job asks for: (rows, extra),
    extra holding ``passkey``, ``context`` and ``probe_curve`` where they apply. Every rank takes part (windows
    sharded, sums all-reduced); rank 0 alone logs progress."""
    e, L, say = job.config.eval, job.config.train.seq_len, log.info if proc.rank == 0 else None
    tokens = job.corpus.tokens[e.split]
    rows = evaluate(model, tokens, list(e.lengths), e.protocol, e.stride, e.max_tokens, e.batch_tokens, proc.device,
                    progress=say, rank=proc.rank, world=proc.world)
    extra = {}
    if "passkey" in e.probes:  # (every rank probes the same model; rank 0 writes)
        settings = {**to_dict(e.passkey), "trained_keys": needles.trained_keys(to_dict(job.config))}
        extra["passkey"] = passkey.record(model, tokens, job.needle, settings, e.split, L, proc.device,
                                          e.batch_tokens, say, job.transfer, job.transfer_kind)
    if "context" in e.probes:  # (each rank scores its share of the windows, gathered on every rank)
        extra["context"] = context.record(model, tokens, to_dict(e.context), e.split, L, list(e.lengths), e.max_tokens,
                                          proc.device, e.batch_tokens, say, proc.rank, proc.world)
        tracker.log_context(extra["context"])
    if e.probe_every and proc.rank == 0:
        extra["probe_curve"] = probe_curve(job.run_dir)
    return rows, extra


def run_record(job: TrainJob, config: dict, rows: list[dict], extra: dict, progress: Progress, wall: float,
               proc: Process, digests: list[str]) -> dict:
    """The finished run's results record (posbench/evaluation/results.py): the evaluation ``rows`` and probes ``extra``, what
    training did (tokens, ``wall`` seconds, the last loss, where it resumed), where it ran, the parameters' digest per
    rank, and a fine-tuned run's lineage."""
    e = job.config.eval
    return results.record(config, rows, job.label, split=e.split, scored_split=job.corpus.same_as.get(e.split, e.split),
                          train_tokens=progress.tokens, train_seconds=wall, device=str(proc.device),
                          threads=proc.threads, world_size=proc.world, world_sizes=progress.world_sizes,
                          status="complete", final_loss=progress.loss if math.isfinite(progress.loss) else None,
                          param_sha256=digests, resumed_from=progress.resumed_from,
                          **lineage_fields(job, progress.tokens), **extra)


def start_process(device: str, threads: int | None, seed: int) -> Process:
    """Join the torchrun process group (if any), take the device and the CPU threads, turn on deterministic
    algorithms on CPU (bit-exact resume; without NaN-filling every new tensor, which would cost ~5% a step) and
    flush denormals to zero there (``device.flush_denormals_from_now``), and seed torch's generator with the run's
    seed."""
    dist.init()
    where = torch.device(dist.device_of(str(resolve_device(device))))
    n = set_threads(threads)
    flush_denormals_from_now(where)
    if where.type == "cpu":
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
    torch.manual_seed(seed)
    return Process(dist.rank(), dist.world(), where, n)


class Loop:
    """The training steps of one process, from a run's :class:`~posbench.training.states.Progress` to
    ``train.steps``: the step function, one host sync every ``train.sync_every`` steps (1 on CPU, 16 on CUDA by
    default; a checkpoint step and the last step always sync), metrics, and the training states that are due."""

    def __init__(self, job: TrainJob, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 states: TrainingStates, proc: Process, tracker: Tracker):
        self.job, self.t, self.model, self.optimizer, self.states = job, job.config.train, model, optimizer, states
        self.proc, self.tracker, self.main = proc, tracker, proc.rank == 0
        net = torch.nn.parallel.DistributedDataParallel(model) if proc.world > 1 else model
        self.forward = Forward(net, compile=self.t.compile)
        dtype = autocast_dtype(self.t.precision, proc.device)  # (train.precision: bf16 on CUDA by default)
        self.autocast = torch.autocast(proc.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)
        self.quiet = not sys.stderr.isatty() or bool(os.environ.get("CI")) or not self.main
        self.probe_every = job.config.eval.probe_every

    def probe(self, step: int, tokens: int, metrics, logged: int) -> None:
        """The passkey probe during training (``eval.probe_every``, and after the last step): exact-match accuracy at L
        and at the longest probe length (the probe's windows, without their controls; with the transfer control's
        keys too), as a ``metrics.jsonl`` row ``{"step", "tokens", "passkey@<T>": accuracy, "transfer@<T>": its
        accuracy}`` and to wandb (past ``logged``, the steps a killed run sent
        already), so a curve shows when copying forms (``training_state.probe_curve``). The step's gradients are dropped first
        (the next step sets them anew), so the probe's activations take their memory."""
        self.optimizer.zero_grad(set_to_none=True)
        e, L = self.job.config.eval, self.t.seq_len
        lengths = sorted({L, max(e.passkey.lengths)})
        trials = passkey.probe(self.model, self.job.corpus.tokens[e.split], self.job.needle, lengths,
                               list(e.passkey.depths), e.passkey.trials, e.passkey.seed, self.proc.device,
                               e.batch_tokens, control=False, transfer=self.job.transfer)
        row = {"step": step, "tokens": tokens, **{f"passkey@{n}": a for n, a in passkey.accuracy(trials).items()},
               **{f"transfer@{n}": a for n, a in passkey.accuracy(trials, "transfer_").items()}}
        metrics.write(json.dumps(row) + "\n")
        if step > logged:
            self.tracker.log_train(step, **{k: v for k, v in row.items() if k != "step"})
        if self.quiet:
            log.info("step %d: passkey accuracy %s", step, ", ".join(
                f"{k[8:]}: {v:.0%}" + (f" ({row[f'transfer@{k[8:]}']:.0%} on {self.job.transfer_kind})"
                                       if f"transfer@{k[8:]}" in row else "")
                for k, v in row.items() if k.startswith("passkey@")))

    def run(self, progress: Progress, stop: StopSignals) -> bool:
        """Train from ``progress.step`` (updated in place) to ``train.steps``. Returns True when a stop signal
        reached some rank (seen at a host sync, after which no step ran), False when every step ran.
        Raises TrainingFailed at a non-finite loss or gradient."""
        t, sync_every = self.t, self.t.sync_every or (1 if self.proc.device.type == "cpu" else 16)
        progress.started, tokens0, window = time.perf_counter(), progress.tokens, []
        with self.states.metrics(progress.step) as (metrics, logged), tqdm(
                total=t.steps, initial=progress.step, desc=f"train {self.job.config.scheme.name}", disable=self.quiet,
                dynamic_ncols=True) as bar:
            for i in range(progress.step, t.steps):
                window.append(self.step(i))
                stop.step_ended()
                progress.step, progress.tokens = i + 1, progress.tokens + t.batch_size * t.seq_len * self.proc.world
                if (self.probe_every and self.main and not stop.received
                        and (progress.step % self.probe_every == 0 or progress.step == t.steps)):
                    self.probe(progress.step, progress.tokens, metrics, logged)
                due = bool(t.checkpoint_every) and progress.step % t.checkpoint_every == 0 and progress.step < t.steps
                if len(window) < sync_every and not due and progress.step < t.steps:
                    continue
                losses, norms, halt = dist.sync_steps([w[2] for w in window], [w[3] for w in window], bool(stop.received))
                tok_s = (progress.tokens - tokens0) / (time.perf_counter() - progress.started)
                synced = [(s, lr, loss, norm) for (s, lr, _, _), loss, norm in zip(window, losses, norms)]
                self.log(synced, tok_s, metrics, logged)
                progress.loss, window = losses[-1], []
                bar.set_postfix(loss=f"{progress.loss:.3f}", lr=f"{synced[-1][1]:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
                bar.update(progress.step - bar.n)
                if halt:
                    return True
                if due:
                    self.states.save(progress, self.model, self.optimizer)
        return False

    def step(self, i: int) -> tuple:
        """Optimizer step ``i`` (0-based) → (its number i + 1, lr, loss, gradient norm), the last two on the device."""
        t, seed = self.t, self.job.config.seed
        lr = t.lr * lr_factor(i, t.warmup_steps, t.steps, t.min_lr / t.lr, t.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        d = self.job.config.data
        x, y = (b.to(self.proc.device, non_blocking=True)
                for b in get_batch(self.job.corpus.tokens["train"], i, seed, t.batch_size, t.seq_len, self.proc.rank,
                                   self.job.needle, d.passkey_rate, d.passkey_pairs,
                                   copy_rate(d.copy_rate, d.copy_until, i, t.steps), self.job.corpus.eos,
                                   self.job.corpus.vocab_size))
        extra = {}
        if t.random_positions:  # (off: the call, and every random number, as without the option)
            extra["pos"] = random_positions(seed, i, self.proc.rank, t.random_positions, t.seq_len).to(self.proc.device)
        if t.pose:  # (the same)
            extra["pos"] = pose_positions(seed, i, self.proc.rank, t.pose, t.seq_len, t.pose_chunks).to(self.proc.device)
        def forward():
            with self.autocast:
                return self.forward(x, targets=y, **extra).mean()  # mean NLL over the batch's B·L targets

        loss = forward()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward.backward(loss, forward, self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip or math.inf)  # 0: no clipping
        self.optimizer.step()  # a non-finite step is found at the next host sync, before any checkpoint is saved
        return i + 1, lr, loss.detach(), grad_norm.detach()

    def log(self, steps: list[tuple], tok_s: float, metrics, logged: int) -> None:
        """The synced (step, lr, loss, grad_norm) of a window: each checked, then written to ``metrics.jsonl``, sent to
        wandb (past ``logged``: the steps a killed run sent already) and, without a progress bar, logged every
        ``train.log_every`` steps. Raises TrainingFailed at the first non-finite one, after marking the run failed."""
        t = self.t
        for s, lr, loss, norm in steps:
            if not (math.isfinite(loss) and math.isfinite(norm)):
                self.fail(s, "loss" if not math.isfinite(loss) else "gradient")
            row = {"step": s, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tok_s}
            if self.main:
                metrics.write(json.dumps(row) + "\n")
                if s > logged:
                    self.tracker.log_train(s, **{k: v for k, v in row.items() if k != "step"})
                if self.quiet and ((s - 1) % t.log_every == 0 or s == t.steps):
                    log.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f tok/s %.0f", s, t.steps, loss, lr, norm, tok_s)

    def fail(self, step: int, what: str) -> None:
        """Mark the run failed at ``step`` (``results.json``, wandb) and raise TrainingFailed."""
        message = f"non-finite {what} at step {step}; the last good checkpoint is kept"
        dist.main_only(lambda: results.write_results(self.job.run_dir, {
            "format": results.FORMAT, "status": "failed", "error": message, "step": step, "results": [],
            "config": to_dict(self.job.config)}))
        self.tracker.summary(status="failed", failed_step=step)
        raise TrainingFailed(message)


def lineage_fields(job: TrainJob, tokens: int) -> dict:
    """A fine-tuned run's ``lineage`` (posbench/training/lineage.py) and ``total_train_tokens`` (the parent's total + its
    own ``tokens``; None when the parent's is unknown), for its record and checkpoint; {} for a run from scratch."""
    if not job.lineage:
        return {}
    total = job.lineage["total_train_tokens"]
    return {"lineage": job.lineage, "total_train_tokens": None if total is None else total + tokens}  # (None: unknown)


def write_outputs(job: TrainJob, model: torch.nn.Module, config: dict, record: dict, tracker: Tracker) -> None:
    """Rank 0's files of a finished run: ``checkpoint.pt`` (with the job's spec), ``results.json``/``.csv``; the
    evaluation to wandb, and the run's table to stdout."""
    tokenizer = {"path": str(job.corpus.tokenizer_path), "key": job.corpus.key}
    checkpoint.save(job.run_dir / checkpoint.NAME, model, job.spec, config, tokenizer, job.config.train.steps,
                    train_tokens=record["train_tokens"], **lineage_fields(job, record["train_tokens"]))
    results.write_results(job.run_dir, record)
    tracker.log_eval(record["results"])
    tracker.log_passkey(*(passkey.accuracy(record["passkey"]["trials"], kind) for kind in ("", "transfer_"))
                        if record.get("passkey") else (None,))
    print(results.run_table(record), flush=True)


def _param_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()
