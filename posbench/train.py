"""The training loop: fit a small causal LM at train length L, checkpoint it, evaluate it at L…16L.

``train(cfg, out_dir)`` is what ``posbench train`` runs inside its Hydra run folder:
prepare data → check the evaluation span → build the model → AdamW with linear warmup and cosine
decay → checkpoints → perplexity at every evaluation length → ``results.json`` / ``results.csv``.
Batches are random crops of L + 1 tokens from the train memmap; batch i is a pure function of
(seed, i, rank), and the learning rate a pure function of the step, so a run resumed from a training
checkpoint (``resume=auto``, the default) sees the same batches and, on CPU with the same thread
count, produces bit-identical losses. Under torchrun the loop runs DDP; rank 0 alone writes.
Per-step metrics go to ``metrics.jsonl`` (and wandb); SIGTERM or SIGUSR2 saves a checkpoint and exits with
:data:`EXIT_PREEMPTED`; a non-finite loss or gradient stops the run, marked failed.
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
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from posbench import checkpoint, data, dist, results, resume
from posbench.config import ConfigError, check_device, finalize, to_dict
from posbench.evaluate import evaluate, span
from posbench.positional import SCHEMES
from posbench.tracking import Tracker

log = logging.getLogger("posbench")
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM/SIGUSR2 after saving a checkpoint; re-run to resume
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)  # a scheduler's stop, and SLURM's warning (--signal=USR2@…)


class TrainingFailed(RuntimeError):
    """A non-finite loss or gradient; the run is marked failed and its last good checkpoint kept."""


class Preempted(Exception):
    """SIGTERM or SIGUSR2 arrived; a checkpoint was saved. The CLI exits with EXIT_PREEMPTED."""


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU. Raises ConfigError as :func:`posbench.config.check_device`."""
    check_device("train.device", name)
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def set_threads(threads: int | None) -> int:
    """Set torch's CPU thread count (default: the cores this process may run on, shared among the
    processes torchrun started on this machine); return it."""
    n = threads or max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(n)
    return n


def get_batch(tokens: np.ndarray, step: int, seed: int, batch_size: int, seq_len: int, rank: int = 0):
    """Batch ``step``: ``batch_size`` random crops of ``seq_len`` + 1 tokens, a pure function of (seed, step, rank).

    Returns (x, y), each (B, L) int64, y = x shifted by one token.
    """
    starts = np.random.default_rng([seed, step, rank]).integers(0, len(tokens) - seq_len - 1, batch_size)
    crops = torch.from_numpy(np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int64))  # (B, L+1)
    return crops[:, :-1], crops[:, 1:]


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


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total`` (Loshchilov & Hutter 2017)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, t: DictConfig, fused: bool) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019). Decayed: the model's matrices (dim ≥ 2: embeddings, projections);
    not decayed: biases and LayerNorm gains. A scheme's parameters (``scheme.*``) are decayed exactly when
    its class says so (``PositionalScheme.weight_decay``), whatever their rank."""
    scheme_decays = model.scheme.weight_decay

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


def check_data(cfg: DictConfig) -> data.Corpus:
    """Prepare the corpus of ``cfg.data`` (cached) and check its splits can serve the run.

    Raises:
        posbench.data.DataError: unusable data.
        ConfigError: the evaluation split is shorter than the longest evaluation length (the message
            gives its token count), or the train split is shorter than L + 1.
    """
    t, e = cfg.train, cfg.eval
    corpus = data.prepare(**to_dict(cfg.data))
    try:
        span(len(corpus.tokens[e.split]), list(e.lengths), e.max_tokens)
    except ValueError as err:
        raise ConfigError(str(err).replace("evaluation split", f"{e.split} split")) from None
    if len(corpus.tokens["train"]) <= t.seq_len + 1:
        raise ConfigError(f"the train split has {len(corpus.tokens['train'])} tokens, too few for train.seq_len={t.seq_len}")
    return corpus


def train(cfg: DictConfig, out_dir: Path, tracker: Tracker | None = None) -> dict:
    """Train (or resume), checkpoint and evaluate one run into ``out_dir``; return the results record.

    ``tracker`` (a :class:`posbench.tracking.Tracker`) receives train and eval metrics.

    Raises:
        ConfigError: a bad value (see ``posbench.config.finalize``), an evaluation split too short, or
            a resume whose config changed (the message names the keys).
        posbench.data.DataError: unusable data.
        checkpoint.CheckpointError: the run folder cannot take a checkpoint.
        TrainingFailed: a non-finite loss or gradient (the step is in the message).
        Preempted: SIGTERM or SIGUSR2 arrived and a checkpoint was saved (for SIGUSR2 a handler installed
            before, such as submitit's, is called first: it may requeue the job and exit instead).
    """
    finalize(cfg, SCHEMES)
    tracker = tracker or Tracker(False, out_dir, "")
    t, e = cfg.train, cfg.eval
    dist.init()
    rank, world, main = dist.rank(), dist.world(), dist.rank() == 0
    device = torch.device(dist.device_of(str(resolve_device(t.device))))
    threads = set_threads(t.threads)
    if device.type == "cpu":  # bit-exact resume; NaN-filling every new tensor (its default) would cost ~5% per step
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
    torch.manual_seed(cfg.seed)
    quiet = not sys.stderr.isatty() or bool(os.environ.get("CI")) or not main
    config = to_dict(cfg)
    corpus = dist.main_only(lambda: check_data(cfg)) or check_data(cfg)  # rank 0 builds the cache, the others read it

    model = checkpoint.build_model(checkpoint.model_spec(config, corpus.vocab_size)).to(device)
    seed_rank(cfg.seed, rank)  # the same weights on every rank; from here on, dropout masks of each rank's own
    optimizer = make_optimizer(model, t, fused=device.type == "cuda")
    step0, seen, wall0, world_sizes = 0, 0, 0.0, [[0, world]]  # world_sizes: [first step, processes] per stretch
    state = resume.resume_state(cfg, out_dir)
    if cfg.resume == "never" and main:  # start over: the old states must not outrank the new ones
        for old in (out_dir / checkpoint.STATES).glob("step-*"):
            old.unlink()
    if state is not None:
        step0, seen, wall0, world_sizes = resume.restore(state, model, optimizer, device)
        log.info("resumed from the checkpoint at step %d in %s", step0, out_dir / checkpoint.STATES)
    nbytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    dist.main_only(lambda: checkpoint.check_room(out_dir / checkpoint.STATES, nbytes))
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    fwd = _compiled(net) if t.compile else net
    sync_every = t.sync_every or (1 if device.type == "cpu" else 16)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("%s: %s params, L=%d, %d steps × %d sequences × %d ranks, device %s, %d threads, data %s",
             cfg.scheme.name, f"{n_params:,}", t.seq_len, t.steps, t.batch_size, world, device, threads, corpus.root)

    def save_state(step: int, loss: float) -> None:
        rngs = dist.gather(resume.rng_state(device))
        dist.main_only(lambda: checkpoint.save_state(out_dir, {
            "format": checkpoint.FORMAT, "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "rng_by_rank": rngs, "train_tokens": seen, "train_seconds": wall0 + time.perf_counter() - start,
            "loss": loss, "world_sizes": world_sizes, "config": config}, t.keep_checkpoints))

    def fail(step: int, what: str) -> None:
        message = f"non-finite {what} at step {step}; the last good checkpoint is kept"
        dist.main_only(lambda: results.write_results(out_dir, {"format": results.FORMAT, "status": "failed", "error": message,
                                                                "step": step, "results": [], "config": config}))
        tracker.summary(status="failed", failed_step=step)
        raise TrainingFailed(message)

    preempted = []  # (signal number, frame) of each stop signal; handled at the next host sync
    previous = {s: signal.signal(s, lambda *sig: preempted.append(sig)) for s in STOP_SIGNALS}
    metrics, logged = resume.metrics_file(out_dir, step0) if main else (None, 0)
    bar = tqdm(total=t.steps, initial=step0, desc=f"train {cfg.scheme.name}", disable=quiet, dynamic_ncols=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    model.train()
    start, seen0 = time.perf_counter(), seen
    last_loss = (state or {}).get("loss", math.nan)  # the last synced step's loss (mean over ranks)
    window = []  # (step, lr, loss, grad_norm) of the steps since the last host sync; losses and norms on the device
    try:
        for step in range(step0, t.steps):
            lr = t.lr * lr_factor(step, t.warmup_steps, t.steps, t.min_lr / t.lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = (b.to(device, non_blocking=True) for b in get_batch(corpus.tokens["train"], step, cfg.seed, t.batch_size, t.seq_len, rank))
            with autocast:
                loss = fwd(x, targets=y).mean()  # mean NLL over the batch's B·L targets
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or math.inf)  # 0: no clipping
            optimizer.step()  # a non-finite step is found at the sync below, before any checkpoint is saved
            seen += x.numel() * world
            window.append((step + 1, lr, loss.detach(), grad_norm.detach()))
            done = step + 1
            checkpoint_due = bool(t.checkpoint_every) and done % t.checkpoint_every == 0 and done < t.steps
            if len(window) < sync_every and not checkpoint_due and done < t.steps:
                continue
            losses, norms, stop = sync_steps([w[2] for w in window], [w[3] for w in window], bool(preempted))
            tok_s = (seen - seen0) / (time.perf_counter() - start)
            for (s, lr_s, _, _), step_loss, norm in zip(window, losses, norms):
                if not (math.isfinite(step_loss) and math.isfinite(norm)):
                    fail(s, "loss" if not math.isfinite(step_loss) else "gradient")
                row = {"step": s, "loss": step_loss, "lr": lr_s, "grad_norm": norm, "tokens_per_s": tok_s}
                if main:
                    metrics.write(json.dumps(row) + "\n")
                    if s > logged:  # wandb already has the steps a killed run logged after its last checkpoint
                        tracker.log_train(s, **{k: v for k, v in row.items() if k != "step"})
                if quiet and main and ((s - 1) % t.log_every == 0 or s == t.steps):
                    log.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f tok/s %.0f", s, t.steps, step_loss, lr_s, norm, tok_s)
            last_loss, window = losses[-1], []
            bar.set_postfix(loss=f"{last_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
            bar.update(done - bar.n)
            if stop:  # a stop signal reached some rank
                save_state(done, last_loss)
                signum, frame = preempted[0] if preempted else (signal.SIGTERM, None)  # (another rank's signal)
                if signum == signal.SIGUSR2 and callable(previous[signum]):  # the handler there first (submitit's
                    previous[signum](signum, frame)  # requeues the SLURM task and exits): its turn, after the save
                raise Preempted(f"{signal.Signals(signum).name} at step {done}: checkpoint saved in "
                                f"{out_dir / checkpoint.STATES}; re-run the same command to resume")
            if checkpoint_due:
                save_state(done, last_loss)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        bar.close()
        if metrics:
            metrics.close()
    wall = wall0 + time.perf_counter() - start
    if step0 < t.steps:
        save_state(t.steps, last_loss)
    digests = dist.gather(_param_digest(model))
    if len(set(digests)) > 1:
        raise TrainingFailed(f"parameters differ across ranks after training: {digests}")

    rows = evaluate(model, corpus.tokens[e.split], list(e.lengths), e.protocol, e.stride, e.max_tokens,
                    e.batch_tokens, device, progress=log.info if main else None, rank=rank, world=world)
    record = results.record(config, rows, split=e.split, scored_split=corpus.same_as.get(e.split, e.split),
                            train_tokens=seen, train_seconds=wall, device=str(device), threads=threads, world_size=world,
                            world_sizes=world_sizes, status="complete",
                            final_loss=last_loss if math.isfinite(last_loss) else None,
                            param_sha256=digests, resumed_from=step0 or None)

    def write_outputs() -> None:
        tokenizer = {"path": str(corpus.tokenizer_path), "key": corpus.key}
        checkpoint.save(out_dir / checkpoint.NAME, model, config, corpus.vocab_size, tokenizer, t.steps, train_tokens=seen)
        results.write_results(out_dir, record)
        tracker.log_eval(rows)
        print(results.run_table(record), flush=True)

    dist.main_only(write_outputs)
    return record


def _compiled(net: torch.nn.Module):
    """``torch.compile(net)``, falling back to eager (with a warning) when compilation fails at the first call;
    once a compiled call has succeeded, an error in a later step is the step's error and propagates."""
    compiled, first = torch.compile(net), True

    def forward(x, **kwargs):
        nonlocal compiled, first
        if not first:
            return compiled(x, **kwargs)
        first = False
        try:
            return compiled(x, **kwargs)
        except Exception as err:  # noqa: BLE001 - any compiler failure at the first call falls back the same way
            log.warning("torch.compile failed (%s: %s); training in eager mode", type(err).__name__, err)
            compiled = net
        return net(x, **kwargs)

    return forward
