"""The training loop: fit a small causal LM at train length L, checkpoint it, evaluate it at L…16L.

``train(cfg, out_dir)`` is what ``posbench train`` runs inside its Hydra run folder:
prepare data → check the evaluation span → build the model → AdamW with linear warmup and cosine
decay → checkpoint → perplexity at every evaluation length → ``results.json`` / ``results.csv``.
Batches are random crops of L + 1 tokens from the train memmap; batch i is a pure function of
(seed, i), so a run is reproducible and a resumed run sees the same batches.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from posbench import checkpoint, data, report
from posbench.config import ConfigError, finalize, to_dict
from posbench.evaluate import evaluate, span
from posbench.positional import SCHEMES
from posbench.tracking import Tracker

log = logging.getLogger("posbench")


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU. Raises ConfigError for CUDA on a machine without it."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but no CUDA device is available; use train.device=cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise ConfigError(f"train.device={name!r} is unknown; choose auto, cpu or cuda")
    return torch.device(name)


def set_threads(threads: int | None) -> int:
    """Set torch's CPU thread count (default: the cores this process may run on); return it."""
    n = threads or len(os.sched_getaffinity(0))
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
    """AdamW with weight decay on matrices (dim ≥ 2) only; biases and LayerNorm gains are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), fused=fused or None)


def train(cfg: DictConfig, out_dir: Path, tracker: Tracker | None = None) -> dict:
    """Train, checkpoint and evaluate one run into ``out_dir``; return the results record.

    ``tracker`` (a :class:`posbench.tracking.Tracker`) receives train and eval metrics.

    Raises:
        ConfigError: a bad value (see ``posbench.config.finalize``) or an evaluation split too short.
        posbench.data.DataError: unusable data.
    """
    finalize(cfg, SCHEMES)
    tracker = tracker or Tracker(False, out_dir, "")
    t, e = cfg.train, cfg.eval
    device = resolve_device(t.device)
    threads = set_threads(t.threads)
    torch.manual_seed(cfg.seed)
    quiet = not sys.stderr.isatty() or bool(os.environ.get("CI"))
    if quiet:
        import datasets

        datasets.disable_progress_bars()
    config = to_dict(cfg)
    corpus = data.prepare(**config["data"])
    eval_tokens = corpus.tokens[e.split]
    try:
        span(len(eval_tokens), list(e.lengths), e.max_tokens)
    except ValueError as err:
        raise ConfigError(str(err).replace("evaluation split", f"{e.split} split")) from None
    if len(corpus.tokens["train"]) <= t.seq_len + 1:
        raise ConfigError(f"the train split has {len(corpus.tokens['train'])} tokens, too few for train.seq_len={t.seq_len}")

    model = checkpoint.build_model(config, corpus.vocab_size).to(device)
    optimizer = make_optimizer(model, t, fused=device.type == "cuda")
    n_params = sum(p.numel() for p in model.parameters())
    log.info("%s: %s params, L=%d, %d steps × %d sequences, device %s, %d threads, data %s",
             cfg.scheme.name, f"{n_params:,}", t.seq_len, t.steps, t.batch_size, device, threads, corpus.root)

    bar = tqdm(total=t.steps, desc=f"train {cfg.scheme.name}", disable=quiet, dynamic_ncols=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    model.train()
    start, seen = time.perf_counter(), 0
    for step in range(t.steps):
        lr = t.lr * lr_factor(step, t.warmup_steps, t.steps, t.min_lr / t.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = (b.to(device, non_blocking=True) for b in get_batch(corpus.tokens["train"], step, cfg.seed, t.batch_size, t.seq_len))
        with autocast:
            logits = model(x)  # (B, L, V)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        seen += x.numel()
        tok_s = seen / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
        bar.update()
        tracker.log_train(step + 1, loss=loss.item(), lr=lr, grad_norm=grad_norm.item(), tokens_per_s=tok_s)
        if quiet and (step % t.log_every == 0 or step == t.steps - 1):
            log.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f tok/s %.0f", step + 1, t.steps, loss.item(), lr, grad_norm, tok_s)
    bar.close()
    wall = time.perf_counter() - start

    tokenizer = {"path": str(corpus.tokenizer_path), "key": corpus.key}
    checkpoint.save(out_dir / checkpoint.NAME, model, config, corpus.vocab_size, tokenizer, t.steps, train_tokens=seen)
    rows = evaluate(model, corpus.tokens[e.split], list(e.lengths), e.protocol, e.stride, e.max_tokens,
                    e.batch_tokens, device, progress=log.info)
    record = report.record(config, rows, split=e.split, train_tokens=seen, train_seconds=wall,
                           device=str(device), threads=threads, final_loss=loss.item())
    report.write_results(out_dir, record)
    tracker.log_eval(rows)
    print(report.run_table(record), flush=True)
    return record
