"""Is a row of the report significantly worse than the best row at one evaluation length?

Two tests, chosen by what the rows carry:

* **Welch's t-test** (Welch 1947) over the per-seed NLLs, when both rows have at least two seeds: the
  unequal-variance two-sample t-test, two-sided; p < 0.05 counts as significantly different. Seeds are
  the replicates: the test asks whether the scheme, not the initialisation, makes the difference.
* **Paired bootstrap over evaluation windows** (Efron & Tibshirani 1993), otherwise: both rows scored
  the same windows of the same targets, so resample window indices with replacement and recompute the
  difference of NLL per token, (Σ nll_A − Σ nll_B) / Σ tokens over the resampled windows. A is
  significantly worse than B when the 95% percentile interval of that difference lies entirely above 0.
  Each row's per-window NLL is the mean over its seeds. Pairing is exact only when both rows scored
  identical windows (identical ``window_tokens``), and a test needs at least :data:`MIN_WINDOWS` of them
  (with fewer, no test over windows can reach the level: the exact sign test's smallest two-sided p is
  2 · 0.5^n, and the percentile interval of 2 windows excludes 0 whenever both differences have one sign);
  otherwise no test is made.

Each column is tested against its own reference: the row with the lowest mean NLL at that length.

All NLLs are in nats: per token for a seed's ``nll``, summed over a window's targets for ``window_nll``.
"""

from __future__ import annotations

import math
import statistics
import warnings

import numpy as np

ALPHA = 0.05  # two-sided significance level of the Welch test
LEVEL = 0.95  # bootstrap confidence level
RESAMPLES = 10_000
SEED = 0  # a fixed generator seed: the same runs always give the same report
MIN_WINDOWS = math.ceil(math.log2(2 / ALPHA))  # the fewest windows whose sign test can reach p < ALPHA: 2 · 0.5^n


def welch_p(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of Welch's t-test (Welch 1947) that samples ``a`` and ``b`` (per-seed NLL, nats/token)
    have the same mean; NaN when it is undefined (both samples without spread)."""
    from scipy.stats import ttest_ind  # here, not at the top: only a report with seeds needs it (0.5 s of start-up)

    with warnings.catch_warnings():  # seeds that agree to round-off (0-step fine-tunes): scipy warns; p is still Welch's
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(ttest_ind(a, b, equal_var=False).pvalue)


def paired_bootstrap(nll_a: list[float], nll_b: list[float], tokens: list[int], resamples: int = RESAMPLES,
                     level: float = LEVEL, seed: int = SEED) -> tuple[float, float]:
    """Percentile interval (Efron & Tibshirani 1993) of (Σ nll_A − Σ nll_B) / Σ tokens, in nats/token, over
    ``resamples`` resamplings with replacement of the windows (``nll_*``: summed NLL in nats per window;
    ``tokens``: targets scored per window, the same windows for A and B). Returns (low, high)."""
    rng = np.random.default_rng(seed)
    diff, tok = np.asarray(nll_a, float) - np.asarray(nll_b, float), np.asarray(tokens, float)
    n, chunk, out = len(diff), max(1, 1_000_000 // len(diff)), []
    for start in range(0, resamples, chunk):  # chunks keep the index matrix small for many windows
        idx = rng.integers(0, n, size=(min(chunk, resamples - start), n))
        out.append(diff[idx].sum(1) / tok[idx].sum(1))
    low, high = np.percentile(np.concatenate(out), [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high)


def wilson(successes: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """The Wilson score interval (Wilson 1927) of a proportion ``successes`` / ``n`` at confidence ``level``."""
    from scipy.stats import binomtest  # here, not at the top: only a report with a probe needs it

    ci = binomtest(successes, n).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided p-value of the exact McNemar test (McNemar 1947) on paired binary outcomes: ``b`` pairs where only
    the first is right, ``c`` where only the second is; the binomial test of b in b + c at ½ (1 when b + c = 0)."""
    from scipy.stats import binomtest  # (see wilson)

    return 1.0 if b + c == 0 else float(binomtest(b, b + c, 0.5).pvalue)


def window_sums(runs: list[tuple[list[float], list[int]] | None]) -> tuple[list[float], list[int]] | None:
    """A row's per-window NLL sums (nats) averaged over its seeds and the windows' token counts, from each
    seed's (``window_nll``, ``window_tokens``); None when a seed lacks them or the seeds scored other windows."""
    if not runs or any(r is None for r in runs) or len({tuple(t) for _, t in runs}) != 1:
        return None
    return [statistics.fmean(v) for v in zip(*(nll for nll, _ in runs))], list(runs[0][1])


def compare(row: dict, best: dict) -> dict:
    """Whether ``row`` is significantly worse than ``best`` (rows with ``nlls``: per-seed NLL in nats/token,
    and ``window_runs``: per seed (window_nll, window_tokens) or None). Returns ``test`` (welch | bootstrap |
    n/a), ``p_value`` (Welch), ``ci_low``/``ci_high`` (bootstrap, nats/token, row minus best),
    ``significantly_worse`` (bool; False when no test could be made) and ``windows`` (bootstrap: how many; n/a:
    how many both rows scored, None when they scored different windows or lack them)."""
    out = {"test": "n/a", "p_value": None, "ci_low": None, "ci_high": None, "significantly_worse": False, "windows": None}
    if len(row["nlls"]) >= 2 and len(best["nlls"]) >= 2:
        p = welch_p(row["nlls"], best["nlls"])
        worse = not math.isnan(p) and p < ALPHA and statistics.fmean(row["nlls"]) > statistics.fmean(best["nlls"])
        return {**out, "test": "welch", "p_value": p, "significantly_worse": worse}
    a, b = window_sums(row["window_runs"]), window_sums(best["window_runs"])
    if a is None or b is None or a[1] != b[1]:
        return out
    if len(a[1]) < MIN_WINDOWS:
        return {**out, "windows": len(a[1])}
    low, high = paired_bootstrap(a[0], b[0], a[1])
    return {**out, "test": "bootstrap", "ci_low": low, "ci_high": high, "significantly_worse": low > 0,
            "windows": len(a[1])}


def summary(nlls: list[float], window_runs: list | None = None) -> dict:
    """One cell of the report from its seeds' NLLs (nats/token): ``ppl`` = exp(mean NLL) (the perplexity of the
    mean loss, not the mean of perplexities), ``ppl_std`` = std over seeds of the per-seed perplexity exp(NLL)
    (0 for one seed), ``nll_mean``, ``nll_std`` (nats/token), ``seeds``; ``nlls`` and ``window_runs`` kept
    for :func:`rank`."""
    ppls = [math.exp(n) for n in nlls]
    return {"ppl": math.exp(statistics.fmean(nlls)), "ppl_std": statistics.stdev(ppls) if len(ppls) > 1 else 0.0,
            "nll_mean": statistics.fmean(nlls), "nll_std": statistics.stdev(nlls) if len(nlls) > 1 else 0.0,
            "seeds": len(nlls), "nlls": list(nlls), "window_runs": window_runs or [None] * len(nlls)}


def rank(column: list[dict]) -> None:
    """Mark, in place, the cells of one evaluation length (:func:`summary` dicts): ``best`` (lowest mean NLL;
    its ``test`` is ``best``) and, for every other cell, :func:`compare` against the best."""
    best = min(column, key=lambda c: c["nll_mean"])
    for c in column:
        c.update(best=c is best, **({"test": "best", "p_value": None, "ci_low": None, "ci_high": None,
                                     "significantly_worse": False, "windows": None} if c is best else compare(c, best)))


def note(cells: list[dict]) -> str:
    """The note under a table (``cells``: one table's :func:`rank`-ed cells, each with its row ``label`` and its
    ``reference_label``): the reference of each length, each test its cells used with its level and source, and
    what † means."""
    tests, references = {c["test"] for c in cells}, {}
    for length, label in sorted({(c["length"], c["reference_label"]) for c in cells}):
        references.setdefault(label, []).append(str(length))
    where = ("; ".join(f"{label} at {', '.join(lengths)}" for label, lengths in references.items())
             if len(references) > 1 else f"{next(iter(references))} at every length")
    notes = [f"★: in each column its reference, the row with the lowest mean NLL at that length ({where}), and every "
             f"row not significantly worse than it at the two-sided level {ALPHA} by the test named here"]
    if "welch" in tests:
        notes.append("where both rows have two or more seeds: Welch's t-test over the per-seed NLLs (Welch 1947), "
                     f"significantly worse when p < {ALPHA} and the mean NLL is higher")
    if "bootstrap" in tests:
        counts = sorted({(c["length"], c["windows"]) for c in cells if c["test"] == "bootstrap"})
        notes.append("where a row has one seed: paired bootstrap over evaluation windows (Efron & Tibshirani 1993; "
                     + ", ".join(f"{w} windows at {length}" for length, w in counts) + f"), {RESAMPLES:,} resamples, "
                     f"significantly worse when the {LEVEL:.0%} CI of the NLL difference (nats/token) lies entirely above "
                     "0; it tests evaluation noise only, and a small difference the same in every window can be "
                     "significant where a larger one that varies between windows is not")
    if "n/a" in tests:
        notes.append(f"†: no test (a row with one seed, and no per-window NLL over the same windows as the reference, "
                     f"or fewer than {MIN_WINDOWS} windows: too few for any test over windows at that level)")
    return "; ".join(notes) + "."


def reason(c: dict) -> str:
    """One :func:`rank`-ed cell's test against its reference in words: ``Welch's t-test over <n> seeds: p = <p>``,
    ``paired bootstrap over <n> windows: NLL difference 95% CI [<low>, <high>] nats/token``, ``no test`` (with the
    windows when too few), or ``the reference``."""
    if c["test"] == "best":
        return "the reference"
    if c["test"] == "welch":
        p = "undefined (no spread over seeds)" if math.isnan(c["p_value"]) else f"{c['p_value']:.2g}"
        return f"Welch's t-test over {c['seeds']} seeds: p = {p}"
    if c["test"] == "bootstrap":
        return (f"paired bootstrap over {c['windows']} windows: NLL difference {LEVEL:.0%} CI "
                f"[{c['ci_low']:+.2g}, {c['ci_high']:+.2g}] nats/token")
    return "no test" + (f" ({c['windows']} windows, fewer than {MIN_WINDOWS})" if c.get("windows") else "")
