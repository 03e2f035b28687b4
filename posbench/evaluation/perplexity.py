"""Perplexity at many evaluation lengths, under the protocols of docs/design.md §6, with per-position loss.

The evaluation protocol alone, pure: a model and tokens in, rows out (``posbench eval``'s job is
posbench/jobs/eval_job.py). ``evaluate(model, tokens, lengths, ...)`` scores the same span of N target tokens at every
evaluation length, so perplexities compare across lengths:

* ``nonoverlapping`` — the stream is cut into consecutive windows of L_eval tokens; each window
  predicts its next L_eval tokens, so every target is scored exactly once (the first target of a window
  with one token of context). A ragged last window covers what is left of the span.
* ``sliding`` (stride S) — windows of L_eval tokens advance by S; the first window scores all its
  targets, every later one only its last S (the final one only what is still unscored), so every target
  is scored exactly once with at least L_eval − S tokens of context where the stream allows.

Perplexity is exp(total NLL / tokens scored), token-weighted; NLL is in nats per token.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from posbench.runtime.device import flush_denormals
from posbench.runtime.dist import all_reduce_sum

BIN_GROWTH = 1.15  # per-position loss: each bin at most 15% wider than where it starts …
MIN_BIN_FRACTION = 128  # … and at least length/128 positions wide, so short-context bins average enough tokens


def span(available: int, lengths: list[int], max_tokens: int | None) -> int:
    """Target tokens N scored at every length: min(budget, available − 1), cut to a multiple of max(lengths).

    Args:
        available: tokens in the evaluation split.
        max_tokens: the budget; None scores the whole split (available − 1 targets, cut as above).
    Raises:
        ValueError: the split is shorter than the longest evaluation length plus one token.
    """
    longest = max(lengths)
    if available - 1 < longest:
        raise ValueError(f"the evaluation split has {available} tokens, fewer than the longest evaluation "
                         f"length {longest} + 1; use shorter eval.lengths or a larger split")
    n = available - 1 if max_tokens is None else min(max_tokens, available - 1)
    return max(longest, n - n % longest)


def windows(n: int, length: int, protocol: str, stride: int | None = None) -> list[tuple[int, int, int]]:
    """The windows that score targets 1…n of a stream: a list of (start, size, first scored index).

    A window feeds inputs tokens[start : start+size] and is scored on the predictions at window indices
    first…size−1 (targets tokens[start+first+1 : start+size+1]). Every target is scored exactly once.
    Raises ValueError for an unknown protocol or a stride outside 1…length.
    """
    if protocol == "nonoverlapping":
        return [(a, min(length, n - a), 0) for a in range(0, n, length)]
    if protocol != "sliding":
        raise ValueError(f"unknown protocol {protocol!r}; choose nonoverlapping or sliding")
    if stride is None or not 1 <= stride <= length:
        raise ValueError(f"stride {stride!r} must be between 1 and the evaluation length {length}")
    size = min(length, n)
    out, done = [(0, size, 0)], size  # targets 1…done are scored
    while done < n:
        end = min(done + stride, n)  # this window's last target
        out.append((end - size, size, size - (end - done)))
        done = end
    return out


def position_bins(length: int) -> np.ndarray:
    """Left edges of the per-position loss bins of a window of ``length`` positions.

    Bins are ``max(1, length // 128)`` positions wide at the start of the window, then grow by 15% a bin
    (log-spaced): a 2048-token window has 28 bins, the first 16 positions wide; a 128-token window starts
    with one bin per position.
    """
    edges, e, width = [], 0, max(1, length // MIN_BIN_FRACTION)
    while e < length:
        edges.append(e)
        e = max(e + width, int(e * BIN_GROWTH))
    return np.array(edges)


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokens: np.ndarray, lengths: list[int], protocol: str = "nonoverlapping",
             stride: int | None = None, max_tokens: int | None = None, batch_tokens: int = 16384,
             device: str | torch.device = "cpu", progress=None, rank: int = 0, world: int = 1) -> list[dict]:
    """Perplexity of ``model`` on ``tokens`` at every evaluation length.

    Under torch.distributed, pass ``rank`` and ``world``: each rank scores windows[rank::world] and the
    NLL sums and token counts are all-reduced, so every target still counts exactly once.

    Args:
        model: ``model(x, targets=y)`` maps (B, T) int64 ids and their (B, T) targets to each target's NLL in
            nats, (B, T) float32 (posbench/model/gpt.py's ``GPT``).
        tokens: 1-D token ids of the evaluation split.
        lengths: evaluation lengths L_eval (tokens per window).
        protocol, stride: see the module docstring.
        max_tokens: budget N of scored targets per length (see :func:`span`; None: the whole split).
        batch_tokens: inputs per forward pass (windows of one size are batched up to this).
        progress: optional callable(str) told which length is being scored.
    Returns:
        One dict per length: ``length``, ``ppl``, ``nll`` (nats/token), ``tokens`` (scored),
        ``windows``, ``nll_by_position`` ({"position": left bin edges, "nll": mean NLL per bin}),
        ``window_nll`` (summed NLL in nats of each window's scored targets, windows in :func:`windows`
        order: what a paired bootstrap between models resamples) and ``window_tokens`` (targets per window).
    Raises:
        ValueError: the split is too short for the longest length (see :func:`span`).
    """
    n = span(len(tokens), lengths, max_tokens)
    stream = torch.from_numpy(np.asarray(tokens[: n + 1], dtype=np.int64))
    was_training = model.training
    model.eval()
    results = []
    for length in lengths:
        if progress:
            progress(f"evaluating at length {length}")
        wins = windows(n, length, protocol, stride)
        mine = list(range(len(wins)))[rank::world]  # indices of this rank's windows
        pos_sum = torch.zeros(length, dtype=torch.float64)
        pos_count = torch.zeros(length, dtype=torch.float64)
        win_sum = torch.zeros(len(wins), dtype=torch.float64)
        for size in sorted({wins[i][1] for i in mine}, reverse=True):
            group = [i for i in mine if wins[i][1] == size]
            per_batch = max(1, batch_tokens // size)
            for b in range(0, len(group), per_batch):
                chunk = group[b: b + per_batch]
                x = torch.stack([stream[wins[i][0]: wins[i][0] + size] for i in chunk]).to(device)  # (B, T)
                y = torch.stack([stream[wins[i][0] + 1: wins[i][0] + size + 1] for i in chunk]).to(device)  # (B, T)
                with flush_denormals(device):
                    nll = model(x, targets=y)  # (B, T), nats
                first = torch.tensor([wins[i][2] for i in chunk], device=device)  # (B,): each window's first scored
                scored = torch.arange(size, device=device)[None, :] >= first[:, None]
                masked = (nll * scored).double().cpu()  # (B, T)
                pos_sum[:size] += masked.sum(0)
                pos_count[:size] += scored.sum(0).double().cpu()
                win_sum[chunk] = masked.sum(1)
        both = all_reduce_sum(torch.cat([pos_sum, pos_count, win_sum]).to(device)).cpu()  # (2·length + windows,)
        pos_sum, pos_count, win_sum = both[:length], both[length: 2 * length], both[2 * length:]
        total, count = pos_sum.sum().item(), int(pos_count.sum().item())
        if count != n:  # the protocol's invariant: a real check, not an assert that python -O removes
            raise RuntimeError(f"evaluation at length {length} scored {count} targets, expected {n}: the "
                               f"{protocol} windows do not cover the span once")
        edges = position_bins(length)
        bounds = list(edges[1:]) + [length]
        by_pos = [pos_sum[a:e].sum().item() / max(1.0, pos_count[a:e].sum().item()) for a, e in zip(edges, bounds)]
        results.append({"length": length, "ppl": math.exp(total / count), "nll": total / count, "tokens": count,
                        "windows": len(wins), "nll_by_position": {"position": edges.tolist(), "nll": by_pos},
                        "window_nll": win_sum.tolist(), "window_tokens": [size - first for _, size, first in wins]})
    model.train(was_training)
    return results
