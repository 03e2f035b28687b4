"""The passkey probe's results across runs: accuracy cells, the validity rule and the paired test (docs/design.md
§6.4 and §8). posbench/report.py renders them beside the perplexity tables; posbench/passkey.py makes the trials.

* :func:`cells` — per row label and probe length: exact-match accuracy with its Wilson 95% interval, the mean
  retrieval gain, and ★ by the exact McNemar test over the trials both rows share, against the best row;
* validity: a row whose accuracy over trials with needle-to-query distance ≤ L is below the probe's threshold
  "does not retrieve within L" and is not ranked at lengths past L;
* :func:`by_distance` and :func:`by_depth` — what the plots draw.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from posbench import stats

DISTANCE_BINS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)  # needle-to-query distance in units of L


def _trials(records: list[dict]) -> dict[str, dict]:
    """{row label: {"trials": {(seed, length, depth, trial): trial}, "L": train length, "threshold": …}} of the
    records holding a probe (``passkey``), their trials pooled over seeds."""
    rows = {}
    for rec in records:
        probe = rec.get("passkey")
        if not probe:
            continue
        row = rows.setdefault(rec["setting"], {"trials": {}, "L": probe["settings"]["train_length"],
                                               "threshold": probe["settings"]["threshold"], "order": rec["order"]})
        for t in probe["trials"]:
            row["trials"][(rec["seed"], t["length"], t["depth"], t["trial"])] = t
    return dict(sorted(rows.items(), key=lambda kv: kv[1]["order"]))


def cells(records: list[dict]) -> list[dict]:
    """One dict per (row label, probe length): ``setting``, ``length``, ``n``, ``correct``, ``accuracy`` and its
    Wilson 95% interval (``ci_low``, ``ci_high``), ``gain`` (mean retrieval gain, nats/token), the row's
    ``within_L`` accuracy (trials with distance ≤ L, every length) and ``valid`` (``within_L`` ≥ the threshold),
    ``ranked`` (valid, or the length ≤ L), ``best`` and ``p_value`` (exact McNemar against the best ranked row of
    that length over the trials both hold; None untested) and ``star`` (best, or p ≥ 0.05; none in a column where
    no ranked row retrieved a key). [] without probes."""
    out = []
    rows = _trials(records)
    for setting, row in rows.items():
        within = [t["correct"] for t in row["trials"].values() if t["distance"] <= row["L"]]
        within_l = statistics.fmean(within) if within else None
        for length in sorted({key[1] for key in row["trials"]}):
            mine = [t for key, t in row["trials"].items() if key[1] == length]
            k, n = sum(t["correct"] for t in mine), len(mine)
            low, high = stats.wilson(k, n)
            valid = within_l is not None and within_l >= row["threshold"]
            out.append({"setting": setting, "length": length, "n": n, "correct": k, "accuracy": k / n, "ci_low": low,
                        "ci_high": high, "gain": statistics.fmean(t["gain"] for t in mine), "within_L": within_l,
                        "valid": valid, "ranked": valid or length <= row["L"], "best": False, "p_value": None,
                        "star": False})
    for length in sorted({c["length"] for c in out}):
        column = [c for c in out if c["length"] == length and c["ranked"]]
        if len(column) < 2 or max(c["accuracy"] for c in column) == 0:  # (nothing retrieved: nothing to rank)
            continue
        best = max(column, key=lambda c: c["accuracy"])
        best["best"] = best["star"] = True
        theirs = {key: t["correct"] for key, t in rows[best["setting"]]["trials"].items() if key[1] == length}
        for c in column:
            if c is best:
                continue
            mine = {key: t["correct"] for key, t in rows[c["setting"]]["trials"].items() if key[1] == length}
            shared = mine.keys() & theirs.keys()
            b = sum(theirs[key] and not mine[key] for key in shared)
            d = sum(mine[key] and not theirs[key] for key in shared)
            c["p_value"] = stats.mcnemar_exact(b, d) if shared else None
            c["star"] = c["p_value"] is not None and c["p_value"] >= stats.ALPHA
    return out


def by_distance(records: list[dict]) -> dict[str, tuple[list, list]]:
    """{row label: (bin centres, accuracy)}: exact-match accuracy against needle-to-query distance in units of L,
    binned by :data:`DISTANCE_BINS` (a bin's centre: the mean distance of its trials), every probe length pooled."""
    out = {}
    for setting, row in _trials(records).items():
        bins = defaultdict(list)
        for t in row["trials"].values():
            x = t["distance"] / row["L"]
            i = next((j for j in range(len(DISTANCE_BINS) - 1) if x <= DISTANCE_BINS[j + 1]), len(DISTANCE_BINS) - 1)
            bins[i].append((x, t["correct"]))
        xs = [statistics.fmean(x for x, _ in bins[i]) for i in sorted(bins)]
        out[setting] = (xs, [statistics.fmean(c for _, c in bins[i]) for i in sorted(bins)])
    return out


def by_depth(records: list[dict]) -> dict[str, tuple[list, list, list]]:
    """{row label: (depths, lengths, accuracy[depth][length])}: the depth × length grid of a heatmap."""
    out = {}
    for setting, row in _trials(records).items():
        depths = sorted({key[2] for key in row["trials"]})
        lengths = sorted({key[1] for key in row["trials"]})
        grid = [[statistics.fmean([t["correct"] for key, t in row["trials"].items() if key[1] == n and key[2] == d] or [0])
                 for n in lengths] for d in depths]
        out[setting] = (depths, lengths, grid)
    return out
