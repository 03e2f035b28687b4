"""The training batches: batch i of a run is a pure function of (seed, i, rank), so a resumed run sees the batches an
uninterrupted one would have, and each curriculum (copy windows, passkey needles with their queries, randomized
positions, PoSE's skips: docs/design.md §6.4, §5.1) draws from a generator of its own, so switching one on
leaves the others' draws as they were.

    x, y = get_batch(tokens, step, seed, batch_size, seq_len, rank)    # (B, L) int64 each, y = x shifted by one
    pos = random_positions(seed, step, rank, high=2048, length=128)     # (L,) int64, sorted, distinct
    pos = pose_positions(seed, step, rank, target=2048, length=128)     # (L,) int64, PoSE's chunks and skips
"""

from __future__ import annotations

import math

import numpy as np
import torch

from posbench.data import needles
from posbench.data.needles import Needle


def get_batch(tokens: np.ndarray, step: int, seed: int, batch_size: int, seq_len: int, rank: int = 0,
              needle: needles.Needle | None = None, passkey_rate: float = 0.0, passkey_pairs: int = 1,
              copy: float = 0.0, separator: int = 0, vocab_size: int = 0):
    """Batch ``step``: ``batch_size`` random crops of ``seq_len`` + 1 tokens, a pure function of (seed, step, rank).
    With ``copy`` > 0 (this step's copy rate: :func:`copy_rate`), each crop becomes a copy window with that probability
    (:func:`copy_spans`: random tokens of ``vocab_size``, ``separator`` between the span and its
    repeat); then, with ``passkey_rate``
    > 0, each other crop gets ``passkey_pairs`` needle + query pairs with that probability (``insert``). Each from a
    generator of its own, so the crops are those of a run without them, and 0 leaves the batch as it was.

    Returns (x, y), each (B, L) int64, y = x shifted by one token.
    """
    starts = np.random.default_rng([seed, step, rank]).integers(0, len(tokens) - seq_len - 1, batch_size)
    crops = np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int64)  # (B, L+1)
    copied = (copy_spans(crops, separator, vocab_size, copy, np.random.default_rng([seed, step, rank, 3]))
              if copy > 0 else None)
    if passkey_rate > 0:
        insert(crops, needle, passkey_rate, np.random.default_rng([seed, step, rank, 1]), passkey_pairs, copied)
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


def pose_positions(seed: int, step: int, rank: int, target: int, length: int, chunks: int = 2) -> torch.Tensor:
    """PoSE's training positions (Zhu et al. 2023, §3.2): the window's L = ``length`` positions cut into N = ``chunks``
    ≥ 2 contiguous chunks, chunk i moved on by a skip u_i, u_0 = 0 and u_i uniform over the integers u_{i−1} … L_t − L
    (L_t = ``target``), so positions stay below L_t, keep their order, and run on by one within a chunk. Chunk
    lengths: for N = 2 the reference code's (its ``train_preprocess_function_pose``: the first chunk uniform over
    1 … ⌈L/2⌉ tokens); for N > 2, where the paper gives no rule, N − 1 distinct cut points uniform over 1 … L − 1.
    Drawn by ``default_rng([seed, step, rank, 4])``, one vector per batch (the model takes one; the reference draws per
    example). (length,) int64."""
    rng = np.random.default_rng([seed, step, rank, 4])
    if chunks == 2:
        cuts = [int(rng.integers(1, (length + 1) // 2 + 1))]
    else:
        cuts = sorted(int(c) for c in rng.choice(np.arange(1, length), chunks - 1, replace=False))
    pos, skip = np.arange(length, dtype=np.int64), 0
    for a, b in zip(cuts, [*cuts[1:], length]):
        skip = int(rng.integers(skip, target - length + 1))  # u_i ∈ {u_{i−1}, …, L_t − L}
        pos[a:b] += skip
    return torch.from_numpy(pos)


def insert(crops: np.ndarray, needle: Needle, rate: float, rng: np.random.Generator, pairs: int = 1,
           skip: np.ndarray | None = None) -> np.ndarray:
    """Training windows with needle + query pairs (``data.passkey_rate``, ``data.passkey_pairs``): each of the
    (B, W) ``crops`` gets ``pairs`` of them with probability ``rate`` (rows in ``skip``, a (B,) bool mask, never),
    overwriting its tokens, each pair with a fresh key. One pair: the query at b uniform in [needle, W − query], the
    needle at a uniform in [0, b − needle]. Several: :func:`layout`, pairs one after another, so each query asks
    for the key of the needle just before it and no query is ambiguous. Returns ``crops`` (changed in place).
    Windows shorter than the pairs' needles and queries are left as they are."""
    width = crops.shape[1]
    last = width - needle.query_length
    for row in np.flatnonzero(rng.random(len(crops)) < rate):
        if last < needle.needle_length or width < pairs * (needle.needle_length + needle.query_length):
            break
        if skip is not None and skip[row]:
            continue
        if pairs == 1:
            key = needle.draw_key(rng)
            b = int(rng.integers(needle.needle_length, last + 1))
            a = int(rng.integers(0, b - needle.needle_length + 1))
            places = [(a, b, key)]
        else:
            places = [(a, b, needle.draw_key(rng)) for a, b in layout(width, needle, pairs, rng)]
        for a, b, key in places:
            crops[row, a: a + needle.needle_length] = [*needle.marker, *key, *needle.end]
            crops[row, b: b + needle.query_length] = [*needle.marker, *key]
    return crops


def layout(width: int, needle: Needle, pairs: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Where ``pairs`` ≥ 1 needle + query pairs go in a window of ``width`` tokens: [(a_i, b_i)], needle i at a_i,
    its query at b_i, in order a_1 < b_1 < a_2 < b_2 < …. Each pair's distance d_i = b_i − a_i (key to key) is drawn
    log-uniformly from [needle, needle + room] (room: the tokens the other pairs leave; the pairs draw in random
    order, so the long one may fall anywhere), then the haystack left over is split into pairs + 1 gaps by uniform
    cut points. The first pair to draw is log-uniform over the whole room, later ones over what is left: every octave of
    distance gets pairs, short ones as a probe's needle at depth 1 and long ones up to the window, with many distinct
    distances (a few would teach a positional shortcut instead of copying: Kawata et al. 2025). (One pair per window,
    :func:`insert`'s default, keeps the older uniform draw.) Raises ValueError when the pairs do not fit in ``width``."""
    n, q = needle.needle_length, needle.query_length
    room = width - pairs * (n + q)
    if room < 0:
        raise ValueError(f"{pairs} needle + query pairs need {pairs * (n + q)} tokens, more than a window of {width}")
    distance = np.zeros(pairs, dtype=np.int64)
    for i in rng.permutation(pairs):
        distance[i] = min(n + room, int(math.exp(rng.uniform(math.log(n), math.log(n + room + 1)))))
        room -= int(distance[i]) - n
    gaps = np.diff([0, *np.sort(rng.integers(0, room + 1, pairs)), room])  # (pairs + 1,) haystack between pairs
    out, at = [], int(gaps[0])
    for i in range(pairs):
        out.append((at, at + int(distance[i])))
        at += int(distance[i]) + q + int(gaps[i + 1])
    return out


def copy_spans(crops: np.ndarray, separator: int, vocab_size: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Copy windows (``data.copy_rate``; Bi-Induct's induction curriculum): each of the (B, W) ``crops`` with
    probability ``rate`` starts with a span of m random tokens (uniform over the vocabulary's ``vocab_size`` ids but
    ``separator``), the ``separator``, the same m tokens again, then goes on with its own text, cut to W (m uniform
    in [1, (W − 1) // 2]). The repeat is predictable only by copying from m + 1 tokens back, the signal an induction
    head learns from (repeated random tokens: Olsson et al. 2022); a span of the corpus's own text would be half
    predictable without it. Returns the (B,) bool mask of the rows made copy windows; ``crops`` changes in place."""
    width = crops.shape[1]
    chosen = rng.random(len(crops)) < rate
    if width < 3:
        return np.zeros(len(crops), dtype=bool)
    for row in np.flatnonzero(chosen):
        m = int(rng.integers(1, (width - 1) // 2 + 1))
        span = rng.integers(0, vocab_size - 1, m)
        span += span >= separator  # (uniform over every id but the separator)
        crops[row] = np.concatenate([span, [separator], span, crops[row]])[:width]
    return chosen
