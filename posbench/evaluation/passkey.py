"""The passkey retrieval probe (Mohtashami & Jaggi 2023): does a model find a key it saw far back in its window?

A window of T tokens is contiguous text of the evaluation split (the haystack) with a needle inserted at depth d:
the marker phrase, a key of k tokens, the end mark; the window ends with the marker phrase again, then the key.
The key's tokens in that query are scored teacher-forced (docs/design.md §6.4):

* exact match: every key token is the model's argmax given the window before it;
* the key's mean log-probability (nats per key token);
* the retrieval gain: that log-probability minus the same key's log-probability in the window whose needle held
  another random key (the control for the model's prior on those tokens);
* the transfer control: the same trials (haystack, depth) with keys of a kind the run never trained on as keys
  (``eval.passkey.transfer``; posbench/data/needles.py ``transfer_kind``), scored the same way, so a model that
  copies whatever follows the marker is told from one that reads only the keys it was trained on.

Trials are a pure function of (seed, T, trial index) and the tokenizer, so every scheme trained on the same corpus
is probed on the same windows, and cells pair across schemes. The needle's format (posbench/data/needles.py) also
serves training (``data.passkey_rate``), with fresh keys and needle-to-query distances within the window.

    needle = make_needle(tokenizer_path, train_tokens, " The pass key is", ".", key_length=4, key_vocab=10, keys="digits")
    rows = probe(model, eval_tokens, needle, lengths=[128, 256], depths=[0, 0.5, 1], trials=20, seed=0)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch

from posbench.data.needles import KEYS, Needle, key_digest, key_fraction


@dataclass
class Config:
    """``eval.passkey``: the probe's options (docs/design.md §6.4), checked by :func:`check`."""

    trials: int = 20  # windows per (length, depth) cell
    depths: List[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])  # needle depth in the haystack
    lengths: Optional[List[int]] = None  # None = eval.lengths
    key_length: int = 4  # k, tokens per key
    keys: str = "digits"  # digits (the original test's) | frequent (whole words) | reserved (absent from train) |
    # half, heldout (the two halves of a seeded split of the corpus's tokens: needles.key_halves)
    key_vocab: Optional[int] = None  # key tokens drawn from: None = the 10 digits, 100 words / reserved tokens, a half
    transfer: Optional[str] = None  # the transfer control's key kind: None = one the run never trained on as keys
    # (needles.transfer_kind), none = no control
    marker: str = " The pass key is"
    end: str = "."
    threshold: float = 0.8  # accuracy within L below which a row "does not retrieve within L"
    seed: int = 0


def check(p) -> None:
    """Raise ValueError (``eval.passkey.<option>=<value> …``) for options of ``p`` (a :class:`Config`, or the config
    node holding its fields, ``lengths`` filled) that cannot make a probe."""
    keys = p["keys"] if hasattr(p, "__getitem__") else p.keys  # (a config node's .keys is its method)
    if keys not in KEYS:
        raise ValueError(f"eval.passkey.keys={keys!r} is unknown; choose one of: {', '.join(KEYS)}")
    if p.transfer not in (None, "none", *KEYS) or p.transfer == keys:
        raise ValueError(f"eval.passkey.transfer={p.transfer!r} is not allowed: choose a key kind other than the "
                         f"probe's {keys} ({', '.join(k for k in KEYS if k != keys)}), none, or leave it unset (a kind "
                         "the run never trained on as keys)")
    if p.key_vocab is None:
        p.key_vocab = KEYS[keys]
    for key in ("trials", "key_length", "key_vocab"):
        value = getattr(p, key)
        if value is None and key == "key_vocab":  # (half, heldout: the whole half)
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"eval.passkey.{key}={value!r} is not allowed: it must be a positive integer")
    if keys == "digits" and p.key_vocab > 10:
        raise ValueError(f"eval.passkey.key_vocab={p.key_vocab} is not allowed with eval.passkey.keys=digits: a digit key "
                         "draws from at most the 10 digits")
    if p.key_vocab is not None and p.key_vocab < p.key_length:
        raise ValueError(f"eval.passkey.key_vocab={p.key_vocab} is smaller than eval.passkey.key_length="
                         f"{p.key_length}: a key draws its tokens from the vocabulary")
    if len(p.depths) == 0 or not all(0 <= d <= 1 for d in p.depths):
        raise ValueError(f"eval.passkey.depths={list(p.depths)} is not allowed: give depths between 0 (the start of the "
                         "haystack) and 1 (its end)")
    if not 0 < p.threshold <= 1:
        raise ValueError(f"eval.passkey.threshold={p.threshold} is not allowed: it must be in (0, 1]")
    if p.seed < 0:
        raise ValueError(f"eval.passkey.seed={p.seed} is not allowed: it must be >= 0")
    if len(p.lengths) == 0 or list(p.lengths) != sorted(set(p.lengths)) or min(p.lengths) < 2:
        raise ValueError(f"eval.passkey.lengths={list(p.lengths)} is not allowed: give increasing lengths >= 2")


@dataclass(frozen=True)
class Trial:
    """One probe window: evaluation length T, needle depth d, trial index, the haystack's ``offset`` in the split, the
    needle's first token ``position``, the key and the control's ``other`` key (k,), and ``distance``: tokens from the
    needle's key to the query's key (the query key starts at T − k, the needle key at position + len(marker))."""

    length: int
    depth: float
    index: int
    offset: int
    position: int
    key: tuple[int, ...]
    other: tuple[int, ...]
    distance: int


def trials(n_tokens: int, needle: Needle, lengths: list[int], depths: list[float], n: int, seed: int) -> list[Trial]:
    """The probe's trials: for each length T, trial i draws (from ``default_rng([seed, T, i])``) the haystack offset
    in [0, n_tokens − H] (H = T − needle − query tokens), the key, then the other key (redrawn until it differs);
    each depth d puts the needle at round(d·H). Raises ValueError: a T too short for a needle and a query (H < 0),
    or a split shorter than a haystack."""
    out = []
    for length in lengths:
        hay = length - needle.needle_length - needle.query_length
        if hay < 0:
            raise ValueError(f"evaluation length {length} is shorter than a needle and a query "
                             f"({needle.needle_length + needle.query_length} tokens): probe longer lengths "
                             "(eval.passkey.lengths) or a shorter marker or key")
        if n_tokens < hay:
            raise ValueError(f"the evaluation split has {n_tokens} tokens, fewer than a haystack of {hay} at length {length}")
        for i in range(n):
            rng = np.random.default_rng([seed, length, i])
            offset = int(rng.integers(0, n_tokens - hay + 1))
            key, other = needle.draw_pair(rng)
            for d in depths:
                p = round(d * hay)
                out.append(Trial(length, float(d), i, offset, p, key, other, (length - needle.k) - (p + len(needle.marker))))
    return out


def transferred(main: list[Trial], needle: Needle, n_tokens: int, seed: int) -> list[Trial]:
    """The transfer control's trials: each trial of ``main`` with the same length, depth, index and haystack offset
    (moved back where a shorter needle's longer haystack would run past the split's ``n_tokens``), keys of ``needle`` (the
    transfer kind's) drawn from ``default_rng([seed, T, i, 1])`` as :func:`trials` draws its own. A needle of another
    length than the probe's (digits take a space token after the marker) changes the haystack by those tokens, so
    the needle sits at round(d·H) of its own H."""
    out, keys = [], {}
    for t in main:
        hay = t.length - needle.needle_length - needle.query_length
        if (t.length, t.index) not in keys:
            keys[(t.length, t.index)] = needle.draw_pair(np.random.default_rng([seed, t.length, t.index, 1]))
        p = round(t.depth * hay)
        out.append(Trial(t.length, t.depth, t.index, max(0, min(t.offset, n_tokens - hay)), p, *keys[(t.length, t.index)],
                         (t.length - needle.k) - (p + len(needle.marker))))
    return out


def window(tokens: np.ndarray, needle: Needle, trial: Trial, control: bool = False) -> np.ndarray:
    """The trial's window, (T,) int64: haystack[:position] + marker + key + end + haystack[position:] + marker +
    key; ``control``: the needle holds the trial's other key (the query still ends with its key)."""
    hay = np.asarray(tokens[trial.offset: trial.offset + trial.length - needle.needle_length - needle.query_length],
                     dtype=np.int64)
    held = trial.other if control else trial.key
    parts = [hay[: trial.position], needle.marker, held, needle.end, hay[trial.position:], needle.marker, trial.key]
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


@torch.no_grad()
def score(model: torch.nn.Module, windows: np.ndarray, k: int, device="cpu",
          batch_tokens: int = 16384) -> tuple[np.ndarray, np.ndarray]:
    """Score the last k tokens of each window teacher-forced. windows: (N, T) int64 → (exact match (N,) bool: every
    one of the k tokens is the argmax of the logits before it; log-probability (N,) float64: the mean over the k
    tokens, nats). ``model(x, last=k)`` gives the logits of the last k positions only (posbench/model/gpt.py's GPT)."""
    n, length = windows.shape
    correct, logp = np.zeros(n, dtype=bool), np.zeros(n)
    per_batch = max(1, batch_tokens // length)
    for b in range(0, n, per_batch):
        x = torch.from_numpy(windows[b: b + per_batch]).to(device)  # (B, T)
        logits = model(x[:, :-1], last=k).float()  # (B, k, V): the positions that predict the key's k tokens
        target = x[:, -k:]  # (B, k)
        lp = torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]  # (B, k)
        correct[b: b + len(x)] = (logits.argmax(-1) == target).all(-1).cpu().numpy()
        logp[b: b + len(x)] = lp.double().mean(-1).cpu().numpy()
    return correct, logp


def probe(model: torch.nn.Module, tokens: np.ndarray, needle: Needle, lengths: list[int], depths: list[float],
          trials_per_cell: int, seed: int, device="cpu", batch_tokens: int = 16384, progress=None,
          control: bool = True, transfer: Needle | None = None) -> list[dict]:
    """Every trial of the probe scored: one dict per trial with ``length``, ``depth``, ``trial``, ``distance``
    (tokens), ``correct`` (exact match), ``logp`` (mean key log-probability, nats/token) and ``gain`` (``logp`` minus
    the control's; None without ``control``, which then scores half the windows); with ``transfer`` (the transfer
    kind's needle), the same three of its trials (:func:`transferred`) as ``transfer_correct``, ``transfer_logp``
    and ``transfer_gain``. Raises ValueError as :func:`trials`."""
    was_training = model.training
    model.eval()
    out = []
    all_trials = trials(len(tokens), needle, lengths, depths, trials_per_cell, seed)
    for length in lengths:
        if progress:
            progress(f"passkey probe at length {length}")
        mine = [t for t in all_trials if t.length == length]
        rows = [{"length": t.length, "depth": t.depth, "trial": t.index, "distance": t.distance} for t in mine]
        kinds = [("", needle, mine)]
        if transfer:
            kinds.append(("transfer_", transfer, transferred(mine, transfer, len(tokens), seed)))
        for prefix, kind, these in kinds:
            wins = np.stack([window(tokens, kind, t, c) for c in (False, True)[:1 + control] for t in these])  # (2N or N, T)
            correct, logp = score(model, wins, kind.k, device, batch_tokens)
            for i, row in enumerate(rows):
                row.update({f"{prefix}correct": bool(correct[i]), f"{prefix}logp": float(logp[i]),
                            f"{prefix}gain": float(logp[i] - logp[len(these) + i]) if control else None})
        out += rows
    model.train(was_training)
    return out


def record(model: torch.nn.Module, tokens: np.ndarray, needle: Needle, settings: dict, split: str, train_length: int,
           device="cpu", batch_tokens: int = 16384, progress=None, transfer: Needle | None = None,
           transfer_kind: str | None = None) -> dict:
    """What a results record holds of the probe (``passkey``): ``settings`` (``eval.passkey``'s, filled, with the
    ``split`` probed, the run's ``train_length`` L, ``key_fraction`` (the share of the split's tokens that are key
    tokens: ``needles.key_fraction``), ``key_digest`` (``needles.key_digest``), and, with a ``transfer`` needle, its
    ``transfer_kind``, ``transfer_key_vocab`` and ``transfer_key_digest``) and every trial (:func:`probe`) on
    ``tokens``."""
    trials_ = probe(model, tokens, needle, list(settings["lengths"]), list(settings["depths"]), settings["trials"],
                    settings["seed"], device, batch_tokens, progress, transfer=transfer)
    more = {"transfer": transfer_kind, "transfer_key_vocab": len(transfer.keys),
            "transfer_key_digest": key_digest(transfer)} if transfer else {"transfer": "none"}
    return {"settings": {**settings, "key_vocab": len(needle.keys), "split": split, "train_length": train_length,
                         "key_fraction": key_fraction(tokens, needle), "key_digest": key_digest(needle), **more},
            "trials": trials_}


def accuracy(trials_: list[dict], prefix: str = "") -> dict[int, float]:
    """{length: exact-match accuracy} of scored trials (:func:`probe`'s); ``prefix="transfer_"``: of their transfer
    control ({} where the trials have none)."""
    lengths = sorted({t["length"] for t in trials_ if f"{prefix}correct" in t})
    return {n: float(np.mean([t[f"{prefix}correct"] for t in trials_ if t["length"] == n])) for n in lengths}
