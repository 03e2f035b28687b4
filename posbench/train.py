"""The training loop: fit a small causal LM at train length L, checkpoint it, evaluate it at L…16L.

``train(job)`` runs a prepared job (posbench/train_job.py) in its run folder: set up the process → build the model
from the job's spec → AdamW with linear warmup, then cosine decay or a constant rate (``train.schedule``) → the
training steps (:class:`Loop`) with training states (posbench/training_state.py) → perplexity at every evaluation length → ``checkpoint.pt``, ``results.json``
and ``results.csv``. Batches are random crops of L + 1 tokens from the train memmap; batch i is a pure function of
(seed, i, rank), and the learning rate a pure function of the step, so a run resumed from a training state
(``resume=auto``, the default) sees the same batches and, on CPU with the same thread count, produces
bit-identical losses. Under torchrun the loop runs DDP; rank 0 alone writes. Per-step metrics go to
``metrics.jsonl`` (and wandb); a
non-finite loss or gradient stops the run, marked failed.
SIGTERM, SIGUSR2 or Ctrl-C saves a checkpoint at the end of the running step and exits (75 or 130:
posbench/signals.py); a re-run of the same command resumes.
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

import numpy as np
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from posbench import build, checkpoint, context, dist, lineage, passkey, results
from posbench.config import to_dict
from posbench.signals import EXIT_PREEMPTED, StopSignals, exit_status  # noqa: F401  (EXIT_PREEMPTED: the CLI's)
from posbench.device import resolve_device, set_threads
from posbench.evaluate import evaluate
from posbench.tracking import Tracker
from posbench.train_job import TrainJob
from posbench.training_state import Progress, TrainingStates

log = logging.getLogger("posbench")


class TrainingFailed(RuntimeError):
    """A non-finite loss or gradient; the run is marked failed and its last good checkpoint kept."""


class Preempted(Exception):
    """SIGTERM, SIGUSR2 or SIGINT arrived and a checkpoint was saved. The CLI exits with ``exit_status``
    (75, or 130 for Ctrl-C: posbench/signals.py)."""

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


@dataclass(frozen=True)
class Process:
    """This process's place in the run: its torchrun rank and world size, its device and CPU threads."""

    rank: int
    world: int
    device: torch.device
    threads: int


def train(job: TrainJob, tracker: Tracker | None = None) -> dict:
    """Train (or resume), checkpoint and evaluate the prepared ``job`` in its run folder ``job.run_dir``; return the
    results record. ``tracker`` (a :class:`posbench.tracking.Tracker`) receives train and eval metrics.

    Raises:
        posbench.checkpoint.CheckpointError: the run folder cannot take a checkpoint.
        TrainingFailed: a non-finite loss or gradient (the step is in the message).
        Preempted: SIGTERM, SIGUSR2 or SIGINT (Ctrl-C) arrived and a checkpoint was saved (for SIGUSR2 a handler
            installed before, such as submitit's, is called first: it may requeue the job and exit instead).
        KeyboardInterrupt: a second Ctrl-C, while the first one's step was still running (no checkpoint).
    """
    cfg, t, e, out_dir = job.config, job.config.train, job.config.eval, job.run_dir
    tracker, config = tracker or Tracker(False, out_dir, ""), to_dict(cfg)
    proc = start_process(t.device, t.threads, cfg.seed)
    model = build.build_model(job.spec).to(proc.device)
    if job.parent and job.state is None:  # a run started from a parent's weights (a resumed one takes its state's)
        lineage.load(model, job.parent, cfg.init_rows, t.seq_len, proc.device)
        log.info("starting from the weights of %s (%s, step %s)", job.parent.path, job.lineage["label"], job.lineage["step"])
    seed_rank(cfg.seed, proc.rank)  # the same weights on every rank; from here on, dropout masks of each rank's own
    optimizer = make_optimizer(model, t, fused=proc.device.type == "cuda")
    states = TrainingStates(out_dir, config, t.keep_checkpoints, proc.device, job.lineage)
    progress = states.start(job.state, model, optimizer, fresh=cfg.resume == "never")
    if progress.resumed_from:
        log.info("resumed from the checkpoint at step %d in %s", progress.step, out_dir / checkpoint.STATES)
    states.check_room(model)
    log.info("%s: %s params, L=%d, %d steps × %d sequences × %d ranks, device %s, %d threads, data %s", cfg.scheme.name,
             f"{sum(p.numel() for p in model.parameters()):,}", t.seq_len, t.steps, t.batch_size, proc.world,
             proc.device, proc.threads, job.corpus.root)
    with StopSignals() as stop:
        if Loop(job, model, optimizer, states, proc, tracker).run(progress, stop):  # a stop signal reached a rank
            states.save(progress, model, optimizer)
            signum, frame = stop.received[0] if stop.received else (signal.SIGTERM, None)  # (another rank's signal)
            if signum == signal.SIGUSR2 and callable(stop.previous[signum]):  # the handler there first (submitit's
                stop.previous[signum](signum, frame)  # requeues the SLURM task and exits): its turn, after the save
            raise Preempted(f"{signal.Signals(signum).name} at step {progress.step}: checkpoint saved in "
                            f"{out_dir / checkpoint.STATES}; to resume, run the same command with "
                            f"hydra.run.dir={out_dir}", exit_status(signum))
    wall = progress.elapsed()
    if (progress.resumed_from or 0) < t.steps:
        states.save(progress, model, optimizer)
    digests = dist.gather(_param_digest(model))
    if len(set(digests)) > 1:
        raise TrainingFailed(f"parameters differ across ranks after training: {digests}")
    rows = evaluate(model, job.corpus.tokens[e.split], list(e.lengths), e.protocol, e.stride, e.max_tokens,
                    e.batch_tokens, proc.device, progress=log.info if proc.rank == 0 else None, rank=proc.rank,
                    world=proc.world)
    if "passkey" in e.probes:  # (every rank probes the same model; rank 0 writes)
        extra = {"passkey": passkey.record(model, job.corpus.tokens[e.split], job.needle, to_dict(e.passkey), e.split,
                                           t.seq_len, proc.device, e.batch_tokens, log.info if proc.rank == 0 else None)}
    else:
        extra = {}
    if "context" in e.probes:  # (each rank scores its share of the windows, gathered on every rank; rank 0 writes)
        extra["context"] = context.record(model, job.corpus.tokens[e.split], to_dict(e.context), e.split, t.seq_len,
                                          list(e.lengths), e.max_tokens, proc.device, e.batch_tokens,
                                          log.info if proc.rank == 0 else None, proc.rank, proc.world)
        tracker.log_context(extra["context"])
    if e.probe_every and proc.rank == 0:
        extra["probe_curve"] = probe_curve(out_dir)
    record = results.record(config, rows, job.label, split=e.split, scored_split=job.corpus.same_as.get(e.split, e.split),
                            train_tokens=progress.tokens, train_seconds=wall, device=str(proc.device),
                            threads=proc.threads, world_size=proc.world, world_sizes=progress.world_sizes,
                            status="complete", final_loss=progress.loss if math.isfinite(progress.loss) else None,
                            param_sha256=digests, resumed_from=progress.resumed_from, **lineage_fields(job, progress.tokens), **extra)
    dist.main_only(lambda: write_outputs(job, model, config, record, tracker))
    return record


def start_process(device: str, threads: int | None, seed: int) -> Process:
    """Join the torchrun process group (if any), take the device and the CPU threads, turn on deterministic
    algorithms on CPU (bit-exact resume; without NaN-filling every new tensor, which would cost ~5% a step), and
    seed torch's generator with the run's seed."""
    dist.init()
    where = torch.device(dist.device_of(str(resolve_device(device))))
    n = set_threads(threads)
    if where.type == "cpu":
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
    torch.manual_seed(seed)
    return Process(dist.rank(), dist.world(), where, n)


class Loop:
    """The training steps of one process, from a run's :class:`~posbench.training_state.Progress` to
    ``train.steps``: the step function, one host sync every ``train.sync_every`` steps (1 on CPU, 16 on CUDA by
    default; a checkpoint step and the last step always sync), metrics, and the training states that are due."""

    def __init__(self, job: TrainJob, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 states: TrainingStates, proc: Process, tracker: Tracker):
        self.job, self.t, self.model, self.optimizer, self.states = job, job.config.train, model, optimizer, states
        self.proc, self.tracker, self.main = proc, tracker, proc.rank == 0
        net = torch.nn.parallel.DistributedDataParallel(model) if proc.world > 1 else model
        self.forward = Forward(net, compile=self.t.compile)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=proc.device.type == "cuda")
        self.quiet = not sys.stderr.isatty() or bool(os.environ.get("CI")) or not self.main
        self.probe_every = job.config.eval.probe_every

    def probe(self, step: int, tokens: int, metrics, logged: int) -> None:
        """The passkey probe during training (``eval.probe_every``, and after the last step): exact-match accuracy at L
        and at the longest probe length (the probe's windows, without their controls), as a ``metrics.jsonl`` row
        ``{"step", "tokens", "passkey@<T>": accuracy}`` and to wandb (past ``logged``, the steps a killed run sent
        already), so a curve shows when copying forms (:func:`probe_curve`). The step's gradients are dropped first
        (the next step sets them anew), so the probe's activations take their memory."""
        self.optimizer.zero_grad(set_to_none=True)
        e, L = self.job.config.eval, self.t.seq_len
        lengths = sorted({L, max(e.passkey.lengths)})
        trials = passkey.probe(self.model, self.job.corpus.tokens[e.split], self.job.needle, lengths,
                               list(e.passkey.depths), e.passkey.trials, e.passkey.seed, self.proc.device,
                               e.batch_tokens, control=False)
        row = {"step": step, "tokens": tokens, **{f"passkey@{n}": a for n, a in passkey.accuracy(trials).items()}}
        metrics.write(json.dumps(row) + "\n")
        if step > logged:
            self.tracker.log_train(step, **{k: v for k, v in row.items() if k != "step"})
        if self.quiet:
            log.info("step %d: passkey accuracy %s", step, ", ".join(f"{k[8:]}: {v:.0%}" for k, v in row.items()
                                                                    if k.startswith("passkey@")))

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
                losses, norms, halt = sync_steps([w[2] for w in window], [w[3] for w in window], bool(stop.received))
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


def probe_curve(run_dir) -> list[dict]:
    """The probe rows of a run's ``metrics.jsonl`` (:meth:`Loop.probe`), in step order: [{"step", "tokens",
    "accuracy": {T: accuracy}}]; [] when the run did not probe during training."""
    path, rows = run_dir / "metrics.jsonl", {}
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        acc = {int(k[8:]): v for k, v in row.items() if k.startswith("passkey@")}
        if acc:
            rows[row["step"]] = {"step": row["step"], "tokens": row["tokens"], "accuracy": acc}
    return [rows[k] for k in sorted(rows)]


def lineage_fields(job: TrainJob, tokens: int) -> dict:
    """A fine-tuned run's ``lineage`` (posbench/lineage.py) and ``total_train_tokens`` (the parent's total + its
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
    tracker.log_probe(record.get("passkey"))
    print(results.run_table(record), flush=True)


def get_batch(tokens: np.ndarray, step: int, seed: int, batch_size: int, seq_len: int, rank: int = 0,
              needle: passkey.Needle | None = None, passkey_rate: float = 0.0, passkey_pairs: int = 1,
              copy: float = 0.0, separator: int = 0, vocab_size: int = 0):
    """Batch ``step``: ``batch_size`` random crops of ``seq_len`` + 1 tokens, a pure function of (seed, step, rank).
    With ``copy`` > 0 (this step's copy rate: :func:`copy_rate`), each crop becomes a copy window with that probability
    (posbench/passkey.py ``copy_spans``: random tokens of ``vocab_size``, ``separator`` between the span and its
    repeat); then, with ``passkey_rate``
    > 0, each other crop gets ``passkey_pairs`` needle + query pairs with that probability (``insert``). Each from a
    generator of its own, so the crops are those of a run without them, and 0 leaves the batch as it was.

    Returns (x, y), each (B, L) int64, y = x shifted by one token.
    """
    starts = np.random.default_rng([seed, step, rank]).integers(0, len(tokens) - seq_len - 1, batch_size)
    crops = np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int64)  # (B, L+1)
    copied = (passkey.copy_spans(crops, separator, vocab_size, copy, np.random.default_rng([seed, step, rank, 3]))
              if copy > 0 else None)
    if passkey_rate > 0:
        passkey.insert(crops, needle, passkey_rate, np.random.default_rng([seed, step, rank, 1]), passkey_pairs, copied)
    crops = torch.from_numpy(crops)
    return crops[:, :-1], crops[:, 1:]


def copy_rate(rate: float, until: float, step: int, steps: int) -> float:
    """The copy-window rate of step ``step`` (0-based) of ``steps``: ``rate`` falling linearly to 0 at step
    ``until`` · ``steps`` (and 0 from there on), so copy windows seed copying early and leave the end of training to
    the corpus (Bi-Induct's annealed curriculum)."""
    end = until * steps
    return rate * max(0.0, 1.0 - step / end) if rate > 0 and end > 0 else 0.0


def random_positions(seed: int, step: int, rank: int, high: int, length: int) -> torch.Tensor:
    """Randomized positional encodings (Ruoss et al. 2023, §3): the positions of batch ``step``'s windows, a sorted
    sample of ``length`` distinct integers from [0, ``high``) drawn by ``default_rng([seed, step, rank, 2])``, the
    same for every window of the batch (the model takes one position vector); evaluation uses 0…T−1. (length,) int64."""
    sample = np.random.default_rng([seed, step, rank, 2]).choice(high, length, replace=False)
    return torch.from_numpy(np.sort(sample).astype(np.int64))


def seed_rank(seed: int, rank: int) -> None:
    """Give torch's global generator (dropout) a stream of its own on each rank, as nanoGPT offsets its seed by
    rank; rank 0 keeps the stream of a single-process run. Call it after the model is built, so the weights are
    the same on every rank. Rank r > 0 is seeded with a 63-bit number drawn from SeedSequence([seed, r])."""
    if rank:
        torch.manual_seed(int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0] >> 1))


def sync_steps(losses: list[torch.Tensor], norms: list[torch.Tensor], stop: bool) -> tuple[list[float], list[float], bool]:
    """The one host sync of a window of steps: each step's loss averaged over ranks, each step's gradient norm
    (the same on every rank after DDP's all-reduce), and whether any rank asked to stop. One all-reduce of
    k + 1 numbers for k steps, where checking each step would cost two all-reduces and several syncs a step."""
    flag = torch.tensor([float(stop)], device=losses[0].device)
    summed = dist.all_reduce_sum(torch.cat([torch.stack(losses).float(), flag])).cpu()  # (k + 1,)
    return (summed[:-1] / dist.world()).tolist(), torch.stack(norms).float().cpu().tolist(), bool(summed[-1])


def lr_factor(step: int, warmup: int, total: int, min_ratio: float, schedule: str = "cosine") -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of ``train.lr``: a linear warmup over
    ``warmup`` steps, then, for ``cosine``, a cosine decay to ``min_ratio`` at ``total`` (Loshchilov & Hutter 2017),
    or, for ``constant``, 1 to the end (Position Interpolation's fine-tuning: linear warmup, then a constant rate;
    Chen et al. 2023, §3.1)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, t: DictConfig, fused: bool) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019). Decayed: the model's matrices (dim ≥ 2: embeddings, projections);
    not decayed: biases, LayerNorm gains and SSMax's s. A scheme's parameters (``scheme.*``, shared or per layer) are
    decayed exactly when its class says so (``PositionalScheme.weight_decay``), whatever their rank."""
    scheme_decays = model.layer_schemes[0].weight_decay

    def decayed(name: str, p: torch.Tensor) -> bool:
        return scheme_decays if name.startswith("scheme.") else p.dim() >= 2

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if decayed(n, p)], "weight_decay": t.weight_decay},
              {"params": [p for n, p in named if not decayed(n, p)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), fused=fused or None)


def _param_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


class Forward:
    """The training forward pass: ``net`` itself, or ``torch.compile(net)`` (``compile``) falling back to eager, with a
    warning, when compiling fails in the first step, in its forward or in its backward (which Inductor compiles at
    the first ``loss.backward()``). Once a step has succeeded, an error is the step's error and propagates."""

    def __init__(self, net: torch.nn.Module, compile: bool):
        self.net, self.run, self.trying = net, torch.compile(net) if compile else net, compile

    def __call__(self, x, **kwargs):
        if not self.trying:
            return self.run(x, **kwargs)
        try:
            return self.run(x, **kwargs)
        except Exception as err:  # noqa: BLE001 - any compiler failure in the first step falls back the same way
            self._fall_back(err)
        return self.run(x, **kwargs)

    def backward(self, loss: torch.Tensor, redo, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """``loss.backward()``; in the first step of a compiled model, a failure falls back to eager, clears the
        gradients and runs the step's forward again (``redo()`` → loss) and its backward. Returns the loss used."""
        if not self.trying:
            loss.backward()
            return loss
        try:
            loss.backward()
        except Exception as err:  # noqa: BLE001 - as in __call__
            self._fall_back(err)
            optimizer.zero_grad(set_to_none=True)
            loss = redo()
            loss.backward()
        self.trying = False
        return loss

    def _fall_back(self, err: Exception) -> None:
        log.warning("torch.compile failed (%s: %s); training in eager mode", type(err).__name__,
                    str(err).splitlines()[0] if str(err) else "")
        self.run, self.trying = self.net, False
