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

from posbench import checkpoint, data, dist, report
from posbench.config import ConfigError, check_device, finalize, to_dict
from posbench.evaluate import evaluate, span
from posbench.positional import SCHEMES
from posbench.tracking import Tracker

log = logging.getLogger("posbench")
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM/SIGUSR2 after saving a checkpoint; re-run to resume
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)  # a scheduler's stop, and SLURM's warning (--signal=USR2@…)
RESUMABLE = ("train.log_every", "train.checkpoint_every", "train.keep_checkpoints", "train.threads",
             "train.device", "data.cache_dir", "eval.", "wandb.", "resume")  # keys a resumed run may change


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


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved configs (plain dicts), excluding :data:`RESUMABLE`."""
    out = []
    for k in sorted(set(old) | set(new)):
        key, a, b = prefix + k, old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_keys(a, b, key + ".")
        elif a != b and not key.startswith(RESUMABLE):
            out.append(key)
    return out


def _param_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def resume_state(cfg: DictConfig, out_dir: Path) -> dict | None:
    """The newest valid training state in ``out_dir`` when ``cfg.resume`` is auto, else None.

    Raises ConfigError when that state was trained with another config (other than :data:`RESUMABLE` keys),
    naming the changed keys. A changed ``train.steps`` is refused too, naming both numbers: the learning-rate
    schedule is a function of it, so a shorter or longer run is not the same run continued. So is a different
    number of processes (torchrun world size) than the state was trained by, naming both."""
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
        saved, world = state.get("world_size"), dist.world()  # states written before it was recorded: unknown
        if saved is not None and saved != world:
            raise ConfigError(f"{out_dir} holds a checkpoint trained by {saved} processes (torchrun ranks) and this "
                              f"run has {world}: the global batch (train.batch_size × ranks), its contents and the "
                              f"effective learning rate would change mid-run; resume with {saved} processes, or "
                              "resume=never to start over here")
    return state


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
    corpus = check_data(cfg) if main else None  # rank 0 first; data.prepare builds once per machine anyway
    dist.barrier()
    corpus = corpus or check_data(cfg)

    model = checkpoint.build_model(checkpoint.model_spec(config, corpus.vocab_size)).to(device)
    optimizer = make_optimizer(model, t, fused=device.type == "cuda")
    step0, seen, wall0 = 0, 0, 0.0
    state = resume_state(cfg, out_dir)
    if cfg.resume == "never" and main:  # start over: the old states must not outrank the new ones
        for old in (out_dir / checkpoint.STATES).glob("step-*"):
            old.unlink()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        if device.type == "cuda" and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"], device)
        step0, seen, wall0 = state["step"], state["train_tokens"], state["train_seconds"]
        log.info("resumed from the checkpoint at step %d in %s", step0, out_dir / checkpoint.STATES)
    if main:
        checkpoint.check_room(out_dir / checkpoint.STATES, 3 * sum(p.numel() * p.element_size() for p in model.parameters()))
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    fwd = _compiled(net) if t.compile else net
    n_params = sum(p.numel() for p in model.parameters())
    log.info("%s: %s params, L=%d, %d steps × %d sequences × %d ranks, device %s, %d threads, data %s",
             cfg.scheme.name, f"{n_params:,}", t.seq_len, t.steps, t.batch_size, world, device, threads, corpus.root)

    def save_state(step: int) -> None:
        if main:
            checkpoint.save_state(out_dir, {
                "format": checkpoint.FORMAT, "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None},
                "train_tokens": seen, "train_seconds": wall0 + time.perf_counter() - start, "loss": loss.item(),
                "world_size": world,
                "config": config}, t.keep_checkpoints)
        dist.barrier()

    preempted = []  # (signal number, frame) of each stop signal; handled at the end of the step
    previous = {s: signal.signal(s, lambda *sig: preempted.append(sig)) for s in STOP_SIGNALS}
    metrics = _metrics_file(out_dir, step0) if main else None
    bar = tqdm(total=t.steps, initial=step0, desc=f"train {cfg.scheme.name}", disable=quiet, dynamic_ncols=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    model.train()
    start = time.perf_counter()
    loss = torch.tensor((state or {}).get("loss", float("nan")))  # the last step's loss (mean over ranks)
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
            shown = dist.all_reduce_sum(loss.detach().clone()) / world  # (the mean over ranks)
            if not (torch.isfinite(shown) and torch.isfinite(grad_norm)):
                message = f"non-finite {'loss' if not torch.isfinite(shown) else 'gradient'} at step {step + 1}; the last good checkpoint is kept"
                if main:
                    report.write_results(out_dir, {"format": report.FORMAT, "status": "failed", "error": message,
                                                   "step": step + 1, "results": [], "config": config})
                    tracker.summary(status="failed", failed_step=step + 1)
                raise TrainingFailed(message)
            optimizer.step()
            loss = shown
            seen += x.numel() * world
            tok_s = (seen - (state or {}).get("train_tokens", 0)) / (time.perf_counter() - start)
            row = {"step": step + 1, "loss": shown.item(), "lr": lr, "grad_norm": grad_norm.item(), "tokens_per_s": tok_s}
            if main:
                metrics.write(json.dumps(row) + "\n")
                tracker.log_train(step + 1, **{k: v for k, v in row.items() if k != "step"})
            bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
            bar.update()
            if quiet and main and (step % t.log_every == 0 or step == t.steps - 1):
                log.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f tok/s %.0f", step + 1, t.steps, row["loss"], lr, row["grad_norm"], tok_s)
            if dist.all_reduce_sum(torch.tensor([float(bool(preempted))], device=device)).item():  # any rank
                save_state(step + 1)
                signum, frame = preempted[0] if preempted else (signal.SIGTERM, None)  # (another rank's signal)
                if signum == signal.SIGUSR2 and callable(previous[signum]):  # the handler there first (submitit's
                    previous[signum](signum, frame)  # requeues the SLURM task and exits): its turn, after the save
                raise Preempted(f"{signal.Signals(signum).name} at step {step + 1}: checkpoint saved in "
                                f"{out_dir / checkpoint.STATES}; re-run the same command to resume")
            if t.checkpoint_every and (step + 1) % t.checkpoint_every == 0 and step + 1 < t.steps:
                save_state(step + 1)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        bar.close()
        if metrics:
            metrics.close()
    wall = wall0 + time.perf_counter() - start
    if step0 < t.steps:
        save_state(t.steps)
    digests = dist.gather(_param_digest(model))
    if len(set(digests)) > 1:
        raise TrainingFailed(f"parameters differ across ranks after training: {digests}")

    rows = evaluate(model, corpus.tokens[e.split], list(e.lengths), e.protocol, e.stride, e.max_tokens,
                    e.batch_tokens, device, progress=log.info if main else None, rank=rank, world=world)
    record = report.record(config, rows, split=e.split, scored_split=corpus.same_as.get(e.split, e.split),
                           train_tokens=seen, train_seconds=wall, device=str(device), threads=threads, world_size=world, status="complete",
                           final_loss=loss.item() if torch.isfinite(loss) else None,
                           param_sha256=digests, resumed_from=step0 or None)
    if main:
        tokenizer = {"path": str(corpus.tokenizer_path), "key": corpus.key}
        checkpoint.save(out_dir / checkpoint.NAME, model, config, corpus.vocab_size, tokenizer, t.steps, train_tokens=seen)
        report.write_results(out_dir, record)
        tracker.log_eval(rows)
        print(report.run_table(record), flush=True)
    return record


def _metrics_file(out_dir: Path, step0: int):
    """``metrics.jsonl`` opened for appending, with rows past ``step0`` (from before a crash) dropped."""
    path = out_dir / "metrics.jsonl"
    if path.exists():
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] > step0:
                    break
            except (json.JSONDecodeError, KeyError, TypeError):
                break  # a torn last row (power loss, full disk): it and anything after it go
            keep.append(line)
        path.write_text("".join(line + "\n" for line in keep))
    return open(path, "a", buffering=1)


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
