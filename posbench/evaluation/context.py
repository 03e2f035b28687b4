"""The context-use probe: does a model use the context beyond its train length L, or only tolerate it?

Perplexity that stays flat past L can mean either (Press et al. 2022, "Train Short, Test Long", ICLR, Appendix B).
This probe tells them apart. Every token at positions L … T−1 of a T-window of the evaluation split is scored twice:

* **full**: with its whole left context in the window (one forward pass over the T tokens);
* **short**: by a sliding window of L tokens with stride S (``eval.context.stride``, default L // 8): windows of L
  inputs starting at S, 2S, …, T − L, each scoring its last S positions, so each token keeps between L − S + 1
  and L tokens of context (itself included), never more than the model saw in training.

Per window the measure is the mean over those T − L positions of NLL_full − NLL_short (nats/token): the negated
long-short difference of LongPPL (Fang et al. 2024, "What is Wrong with Perplexity for Long-context Language
Modeling?", arXiv:2410.23771), asked of every token. Negative: the model predicts better with the context beyond L;
0: it ignores that context; positive: the longer context hurts. Per evaluation length T > L: the mean over windows,
a percentile bootstrap 95% interval over windows (Efron & Tibshirani 1993), and the mean full and short NLL.

The T-windows are the consecutive windows of the perplexity span (posbench/evaluation/perplexity.py ``span``): the same
tokens perplexity scores, every window of them or ``eval.context.windows`` evenly spaced ones.

    posbench eval run=outputs/2026-11-21/10-00-00_alibi 'eval.probes=[context]'
    posbench train scheme=alibi 'eval.probes=[context]' eval.context.stride=32

    rows = measure(model, tokens, train_length=128, lengths=[256, 512], stride=16)   # per-window values
    probe = record(model, tokens, {"stride": 16, "windows": None, "bootstrap": 1000, "seed": 0}, "validation",
                   128, [128, 256, 512])                                           # what results.json holds
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from posbench.evaluation.perplexity import span
from posbench.runtime import dist

LEVEL = 0.95  # the bootstrap interval's confidence level


@dataclass
class Config:
    """``eval.context``: the probe's options (docs/design.md §6.5), checked and filled by :func:`check`."""

    stride: Optional[int] = None  # S, tokens a short window advances; None = L // 8 (at least 1)
    windows: Optional[int] = None  # T-windows per evaluation length, evenly spaced; None = every one of the span
    bootstrap: int = 1000  # resamples of the windows for the 95% interval
    seed: int = 0  # the bootstrap's generator seed


def _positive(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def check(c, seq_len: int, lengths: list[int] | None = None) -> None:
    """Fill ``c.stride`` (None → max(1, L // 8), L = ``seq_len``) and raise ValueError (``eval.context.<option>=<value>
    …``) for options of ``c`` (a :class:`Config`, or the config node holding its fields) that cannot make a probe.
    With ``lengths`` (the evaluation lengths, when the probe runs) also refuse a set without a length above L and a
    stride that does not divide T − L for every such T (the short windows must tile positions L … T−1)."""
    default = c.stride is None
    if default:
        c.stride = max(1, seq_len // 8)
    if not _positive(c.stride) or c.stride > seq_len:
        raise ValueError(f"eval.context.stride={c.stride!r} is not allowed: it must be an integer between 1 and the "
                         f"train length L={seq_len}")
    if c.windows is not None and not _positive(c.windows):
        raise ValueError(f"eval.context.windows={c.windows!r} is not allowed: give a positive number of windows per "
                         "evaluation length, or null for every window")
    if not _positive(c.bootstrap):
        raise ValueError(f"eval.context.bootstrap={c.bootstrap!r} is not allowed: it must be a positive integer "
                         "(resamples)")
    if isinstance(c.seed, bool) or not isinstance(c.seed, int) or c.seed < 0:
        raise ValueError(f"eval.context.seed={c.seed!r} is not allowed: it must be an integer >= 0")
    if lengths is None:
        return
    longer = [n for n in lengths if n > seq_len]
    if not longer:
        raise ValueError(f"eval.lengths={list(lengths)} has no evaluation length above the train length L={seq_len}: "
                         "the context probe (eval.probes=[context]) scores positions past L; add a longer length")
    for n in longer:
        if (n - seq_len) % c.stride:
            g = math.gcd(*[m - seq_len for m in longer])
            fits = max(d for d in range(1, min(g, seq_len) + 1) if g % d == 0 and d <= max(1, seq_len // 8))
            raise ValueError(f"eval.context.stride={c.stride}{' (the default, L // 8)' if default else ''} does not "
                             f"divide T − L = {n - seq_len} at evaluation length {n} (L={seq_len}): give a stride that "
                             f"divides every T − L, e.g. eval.context.stride={fits}")


def short_windows(length: int, train_length: int, stride: int) -> list[tuple[int, int]]:
    """The short-context windows of one T-window (T = ``length``): [(s, first)], each feeding window tokens
    s … s + L − 1 (L = ``train_length``) and scoring its positions first … L − 1, i.e. window positions
    s + first … s + L − 1; s = S, 2S, …, T − L and first = L − S (S = ``stride``). Together they score positions
    L … T − 1 exactly once, in order, position p with p − s + 1 ∈ [L − S + 1, L] tokens of context.
    Raises ValueError when S is outside 1 … L or does not divide T − L, or T ≤ L."""
    if not 1 <= stride <= train_length or length <= train_length or (length - train_length) % stride:
        raise ValueError(f"stride {stride} must be between 1 and L={train_length} and divide T − L = "
                         f"{length - train_length} (T={length} > L)")
    return [(s, train_length - stride) for s in range(stride, length - train_length + 1, stride)]


def window_starts(n_targets: int, length: int, cap: int | None = None) -> np.ndarray:
    """Offsets (int64) of the T-windows in a span of ``n_targets`` targets: the consecutive windows 0, T, 2T, …
    (``n_targets // T`` of them), or ``cap`` of them evenly spaced (window ⌊i·n / cap⌋, i = 0 … cap − 1)."""
    n = n_targets // length
    index = np.arange(n) if cap is None or cap >= n else (np.arange(cap) * n) // cap
    return index.astype(np.int64) * length


@torch.no_grad()
def score(model: torch.nn.Module, stream: torch.Tensor, starts: np.ndarray, size: int, first: int,
          batch_tokens: int = 16384, device="cpu") -> np.ndarray:
    """The NLL (nats, float64) of window positions first … size − 1 of the windows at ``starts`` of ``stream``
    (1-D int64: inputs stream[o : o + size], targets shifted by one, so it holds max(starts) + size + 1 tokens or
    more): (N, size − first) for N = len(starts). ``model(x, targets=y)`` gives per-token NLL (B, T)
    (posbench/model/gpt.py's GPT); passes hold up to ``batch_tokens`` inputs. The caller sets the model's mode."""
    out, per_batch = np.zeros((len(starts), size - first)), max(1, batch_tokens // size)
    for b in range(0, len(starts), per_batch):
        o = torch.as_tensor(np.asarray(starts[b: b + per_batch], dtype=np.int64))  # (B,)
        w = stream[o[:, None] + torch.arange(size + 1)].to(device)  # (B, size + 1)
        out[b: b + len(o)] = model(w[:, :-1], targets=w[:, 1:])[:, first:].double().cpu().numpy()  # (B, size − first)
    return out


def measure(model: torch.nn.Module, tokens: np.ndarray, train_length: int, lengths: list[int], stride: int,
            max_tokens: int | None = None, windows: int | None = None, batch_tokens: int = 16384, device="cpu",
            progress=None, rank: int = 0, world: int = 1) -> list[dict]:
    """Per-window values of the probe at every evaluation length T > L of ``lengths``: one dict per T with
    ``length``, ``starts`` (window offsets in the split, :func:`window_starts` over the perplexity span of
    ``lengths`` and ``max_tokens``), ``diff``, ``full`` and ``short`` (per window, the mean over positions
    L … T − 1 of NLL_full − NLL_short, NLL_full and NLL_short, nats/token).

    NLL_full: one pass over each T-window (:func:`score`, first = L). NLL_short: the windows of
    :func:`short_windows`, each scored once however many T-windows hold it (a short window depends on its start
    in the split only, and windows of different T share most starts). The model is scored in eval mode and left
    in the mode it was in. Under torch.distributed, rank r scores T-windows r, r + world, … and the values are
    gathered, so every rank returns them all. Raises ValueError: the split is too short for the longest length
    (``evaluate.span``), or a stride that :func:`short_windows` refuses."""
    n_targets = span(len(tokens), lengths, max_tokens)
    stream = torch.from_numpy(np.asarray(tokens[: n_targets + 1], dtype=np.int64))
    L, probed = train_length, [n for n in lengths if n > train_length]
    if not probed:
        return []
    starts = {n: window_starts(n_targets, n, windows) for n in probed}
    mine = {n: np.arange(len(starts[n]))[rank::world] for n in probed}
    shorts = {}  # T → (N_mine, M) start in the split of each short window of each of this rank's T-windows
    for n in probed:
        offsets = np.asarray([s for s, _ in short_windows(n, L, stride)], dtype=np.int64)  # (M,)
        shorts[n] = starts[n][mine[n]][:, None] + offsets[None, :]
    unique = np.unique(np.concatenate([a.reshape(-1) for a in shorts.values()]))  # every short window once
    was_training = model.training
    model.eval()
    if progress:
        progress(f"context probe: {len(unique)} windows of L={L} (stride {stride})")
    short_nll = score(model, stream, unique, L, L - stride, batch_tokens, device)  # (U, S)
    out = []
    for n in probed:
        if progress:
            progress(f"context probe at length {n}")
        full = score(model, stream, starts[n][mine[n]], n, L, batch_tokens, device)  # (N_mine, T − L)
        short = short_nll[np.searchsorted(unique, shorts[n])].reshape(len(full), n - L)  # positions L … T−1 in order
        parts = dist.gather((mine[n].tolist(), (full - short).mean(1).tolist(), full.mean(1).tolist(),
                             short.mean(1).tolist()))
        values = np.zeros((3, len(starts[n])))  # diff, full, short per window
        for index, *columns in parts:
            values[:, index] = columns
        out.append({"length": n, "starts": starts[n].tolist(), "diff": values[0].tolist(),
                    "full": values[1].tolist(), "short": values[2].tolist()})
    model.train(was_training)
    return out


def interval(values, resamples: int, seed: int, length: int, level: float = LEVEL) -> tuple[float, float]:
    """The percentile bootstrap interval (Efron & Tibshirani 1993) of the mean of ``values`` (one per window):
    ``resamples`` resamplings of the windows with replacement, from ``numpy.random.default_rng([seed, length])``
    (so each evaluation length T has its own draws). Returns (low, high) at confidence ``level``."""
    rng, x = np.random.default_rng([seed, length]), np.asarray(values, dtype=np.float64)
    chunk, means = max(1, 1_000_000 // len(x)), []
    for start in range(0, resamples, chunk):  # chunks keep the index matrix small for many windows
        means.append(x[rng.integers(0, len(x), size=(min(chunk, resamples - start), len(x)))].mean(1))
    low, high = np.percentile(np.concatenate(means), [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high)


def record(model: torch.nn.Module, tokens: np.ndarray, settings: dict, split: str, train_length: int,
           lengths: list[int], max_tokens: int | None = None, device="cpu", batch_tokens: int = 16384, progress=None,
           rank: int = 0, world: int = 1) -> dict:
    """What a results record holds of the probe (``context``): ``settings`` (``eval.context``'s, filled, with the
    ``split`` scored and the run's ``train_length`` L) and ``rows``, one per evaluation length T > L of ``lengths``:
    ``length``, ``windows`` (count), ``diff`` (mean over windows, nats/token), ``ci_low``/``ci_high``
    (:func:`interval`), ``nll_full``/``nll_short`` (means over windows), ``per_window`` (each window's difference)
    and ``starts`` (each window's offset in the split), what the report pools over seeds (:func:`cells`)."""
    rows = []
    for r in measure(model, tokens, train_length, lengths, settings["stride"], max_tokens, settings["windows"],
                     batch_tokens, device, progress, rank, world):
        low, high = interval(r["diff"], settings["bootstrap"], settings["seed"], r["length"])
        rows.append({"length": r["length"], "windows": len(r["diff"]), "diff": float(np.mean(r["diff"])),
                     "ci_low": low, "ci_high": high, "nll_full": float(np.mean(r["full"])),
                     "nll_short": float(np.mean(r["short"])), "per_window": r["diff"], "starts": r["starts"]})
    return {"settings": {**settings, "split": split, "train_length": train_length}, "rows": rows}


def table(probe: dict) -> str:
    """A record's probe (:func:`record`) as a terminal table: per evaluation length, windows, the mean difference
    with its interval, and the mean full and short NLL."""
    s = probe["settings"]
    L, S = s["train_length"], s["stride"]
    lines = [f"context use past L={L} (stride {S}: short windows keep {L - S + 1}…{L} tokens; {s['split']} split): "
             "NLL with the whole window − NLL with ≤ L tokens, nats/token; negative = uses context beyond L",
             f"{'length':>8} {'windows':>8} {'diff':>9} {'95% interval':>21} {'nll_full':>9} {'nll_short':>9}"]
    for r in probe["rows"]:
        ci = f"[{r['ci_low']:.4f}, {r['ci_high']:.4f}]"
        lines.append(f"{r['length']:>8} {r['windows']:>8} {r['diff']:>9.4f} {ci:>21} {r['nll_full']:>9.4f} "
                     f"{r['nll_short']:>9.4f}")
    return "\n".join(lines)


# ---- many runs: the report's cells -------------------------------------------------------------------------


def probe_key(settings: dict) -> tuple:
    """What makes two probes' numbers comparable: split, train length L and stride (windows pair by their offset)."""
    return settings.get("split"), settings["train_length"], settings["stride"]


def cells(records: list[dict]) -> list[dict]:
    """One dict per (probe table, row label, evaluation length) of the records holding a probe (``context``;
    records without one are left out): ``table`` (1, 2, … one per :func:`probe_key`, the most records first),
    ``settings`` (the table's first record's), ``setting``, ``length``, ``windows`` and ``seeds`` (counts),
    ``diff`` (the mean over windows of each window's difference averaged over the row's seeds that scored it:
    seeds pool per window, by offset), ``ci_low``/``ci_high`` (:func:`interval` over those windows, with the
    table's bootstrap settings), ``nll_full``/``nll_short`` (the mean over the seeds' rows). Rows follow the
    records' ``order`` (the perplexity table's). [] without probes."""
    groups: dict[tuple, dict] = defaultdict(dict)
    for rec in records:
        probe = rec.get("context")
        if not probe:
            continue
        row = groups[probe_key(probe["settings"])].setdefault(rec["setting"], {
            "order": rec["order"], "settings": probe["settings"], "windows": defaultdict(dict), "rows": defaultdict(dict)})
        for r in probe["rows"]:
            row["rows"][r["length"]].setdefault(repr(rec["seed"]), r)
            for start, d in zip(r.get("starts", range(len(r["per_window"]))), r["per_window"]):
                row["windows"][(r["length"], start)].setdefault(repr(rec["seed"]), d)
    ranked = sorted(groups.values(), key=lambda rows: -sum(len(r["rows"]) for r in rows.values()))
    out = []
    for table_, rows in enumerate(ranked, 1):
        first = next(iter(rows.values()))["settings"]
        for setting, row in sorted(rows.items(), key=lambda kv: kv[1]["order"]):
            for length in sorted(row["rows"]):
                diffs = [statistics.fmean(seeds.values()) for (n, _), seeds in row["windows"].items() if n == length]
                low, high = interval(diffs, first["bootstrap"], first["seed"], length)
                seeds = row["rows"][length].values()
                out.append({"table": table_, "settings": first, "setting": setting, "length": length,
                            "windows": len(diffs), "seeds": len(seeds), "diff": statistics.fmean(diffs),
                            "ci_low": low, "ci_high": high, "nll_full": statistics.fmean(r["nll_full"] for r in seeds),
                            "nll_short": statistics.fmean(r["nll_short"] for r in seeds)})
    return out


def series(cells_: list[dict]) -> dict[str, tuple[list, list, list, list]]:
    """{row label: (lengths, diff, ci_low, ci_high)} of the first probe table: what ``context_vs_length.png`` draws."""
    out: dict[str, tuple[list, list, list, list]] = {}
    for c in cells_:
        if c["table"] == 1:
            for values, key in zip(out.setdefault(c["setting"], ([], [], [], [])), ("length", "diff", "ci_low", "ci_high")):
                values.append(c[key])
    return out
