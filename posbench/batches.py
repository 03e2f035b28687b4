"""The training batches: batch i of a run is a pure function of (seed, i, rank), so a resumed run sees the batches an
uninterrupted one would have, and each curriculum (copy windows, passkey needles, randomized positions) draws from a
generator of its own, so switching one on leaves the others' draws as they were.

    x, y = get_batch(tokens, step, seed, batch_size, seq_len, rank)    # (B, L) int64 each, y = x shifted by one
    pos = random_positions(seed, step, rank, high=2048, length=128)     # (L,) int64, sorted, distinct
"""

from __future__ import annotations

import numpy as np
import torch

from posbench import passkey


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
