"""The passkey probe's results across runs: accuracy cells, the validity rule and the paired test (docs/design.md
§6.4 and §8). posbench/report/render.py renders them beside the perplexity tables; posbench/evaluation/passkey.py
makes the trials.

* :func:`cells` — one table per probe (its split, seed, key length, key vocabulary, marker and depths: records of
  other probes scored other windows and are never pooled); per row label and probe length: exact-match accuracy
  with its Wilson 95% interval, the mean retrieval gain, and ★ by a paired test over the windows both rows were
  probed on, against the best row;
* validity: a row whose accuracy in windows no longer than its train length L is below the probe's threshold "does
  not retrieve within L" and is not ranked at lengths past L;
* transfer: the same windows with keys of a kind the run never trained on as keys (the probe's transfer control);
  a row "reads trained keys only" (:func:`reads_only`) when its transfer accuracy is below half its accuracy and
  the two Wilson intervals do not overlap;
* :func:`by_distance`, :func:`by_depth` and :func:`probe_curves` — what the plots draw;
* :func:`run_cells` and :func:`table` — one run's probe, as ``results.csv`` and the terminal show it.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from posbench.evaluation import stats

KEY_KINDS = {"digits": "digits", "frequent": "frequent words", "reserved": "tokens absent from training",
             "half": "tokens of the key half", "heldout": "tokens of the held-out half"}  # in words
DISTANCE_BINS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)  # needle-to-query distance in units of L


def probe_key(settings: dict) -> tuple:
    """What makes two probes' trials the same windows: split, seed, key kind (a record from before
    ``eval.passkey.keys`` drew frequent words), key length, key vocabulary, marker, end mark."""
    return (settings.get("split"), settings["seed"], settings.get("keys", "frequent"), settings["key_length"],
            settings["key_vocab"], settings["marker"], settings["end"])


def groups(records: list[dict]) -> dict[tuple, dict[str, dict]]:
    """{probe key: {row label: row}} of the records holding a probe (``passkey``), probes with the most records first;
    a row: ``windows`` {(length, depth, trial): {seed: trial}} (a seed's first record of a window counts), its train
    length ``L``, the probe's ``threshold`` and ``settings``, and ``order`` (the perplexity rows' order)."""
    out = defaultdict(dict)
    for rec in records:
        probe = rec.get("passkey")
        if not probe:
            continue
        row = out[probe_key(probe["settings"])].setdefault(rec["setting"], {
            "windows": defaultdict(dict), "L": probe["settings"]["train_length"], "order": rec["order"],
            "threshold": probe["settings"]["threshold"], "settings": probe["settings"]})
        for t in probe["trials"]:
            row["windows"][(t["length"], t["depth"], t["trial"])].setdefault(repr(rec["seed"]), t)
    ranked = sorted(out.items(), key=lambda kv: -sum(len(r["windows"]) for r in kv[1].values()))
    return {key: dict(sorted(rows.items(), key=lambda kv: kv[1]["order"])) for key, rows in ranked}


def _rate(outcomes: list[bool]) -> float:
    return sum(outcomes) / len(outcomes)


def reads_only(correct: int, transfer_correct: int, n: int) -> bool:
    """The transfer rule: True ("reads trained keys only") when, of the same ``n`` trials, the transfer control's
    exact-match accuracy is below half the probe's own and their Wilson 95% intervals do not overlap (the transfer
    interval's top below the probe's bottom); False otherwise, so a row that retrieves no key of either kind is not
    marked (it reads neither)."""
    low, _ = stats.wilson(correct, n)
    _, high = stats.wilson(transfer_correct, n)
    return transfer_correct / n < correct / n / 2 and high < low


def _transfer(trials: list[dict]) -> dict:
    """The transfer columns of a cell's ``trials``: ``transfer_correct``, ``transfer_accuracy``, its Wilson interval
    (``transfer_ci_low``, ``transfer_ci_high``), ``transfer_gain`` and ``reads_only`` (:func:`reads_only`); None for
    each when the trials have no transfer control (a record from before it, or ``eval.passkey.transfer=none``)."""
    keys = ("transfer_correct", "transfer_accuracy", "transfer_ci_low", "transfer_ci_high", "transfer_gain", "reads_only")
    if not trials or any("transfer_correct" not in t for t in trials):
        return dict.fromkeys(keys)
    n, k = len(trials), sum(t["transfer_correct"] for t in trials)
    low, high = stats.wilson(k, n)
    gains = [t["transfer_gain"] for t in trials if t["transfer_gain"] is not None]
    return dict(zip(keys, (k, k / n, low, high, statistics.fmean(gains) if gains else None,
                           reads_only(sum(t["correct"] for t in trials), k, n))))


def cells(records: list[dict]) -> list[dict]:
    """One dict per (probe table, row label, probe length): ``table`` (1, 2, … as :func:`groups` orders the probes),
    ``settings`` (the probe's), ``setting``, ``length``, ``n`` (trials: windows × seeds), ``correct``, ``accuracy``
    and its Wilson 95% interval (``ci_low``, ``ci_high``), ``gain`` (mean retrieval gain, nats/token), the row's
    ``within_L`` accuracy (every trial in a window of length ≤ L; None when no probe length is ≤ L) and ``valid``
    (``within_L`` ≥ the threshold), ``ranked`` (valid, or the length ≤ L), ``best``, ``p_value`` and ``star``; the
    transfer control's columns at that length (:func:`_transfer`: ``transfer_accuracy`` … ``reads_only``), and the
    row's ``within_L_transfer`` accuracy and ``reads_only_within_L`` (the rule on every trial within L; None without
    a control or a probe length ≤ L).

    The test, at each length, against the best ranked row (highest accuracy; none when no ranked row retrieved a key):
    a paired sign test over the windows both rows were probed on, of each window's accuracy over the row's seeds
    (one seed: the exact McNemar test, McNemar 1947); ``star``: best, or p ≥ 0.05; ``p_value`` None: untested (no
    shared window). [] without probes."""
    out = []
    for table, rows in enumerate(groups(records).values(), 1):
        mine_cells = []
        for setting, row in rows.items():
            within = [o for (n, _, _), seeds in row["windows"].items() if n <= row["L"] for o in seeds.values()]
            within_l = _rate([o["correct"] for o in within]) if within else None
            valid = within_l is not None and within_l >= row["threshold"]
            moved = _transfer(within)
            for length in sorted({key[0] for key in row["windows"]}):
                trials = [o for key, seeds in row["windows"].items() if key[0] == length for o in seeds.values()]
                k, n = sum(t["correct"] for t in trials), len(trials)
                low, high = stats.wilson(k, n)
                mine_cells.append({"table": table, "settings": row["settings"], "setting": setting, "length": length,
                                   "n": n, "correct": k, "accuracy": k / n, "ci_low": low, "ci_high": high,
                                   "gain": statistics.fmean(t["gain"] for t in trials), "within_L": within_l,
                                   "valid": valid, "ranked": valid or length <= row["L"], "best": False,
                                   "p_value": None, "star": False, **_transfer(trials),
                                   "within_L_transfer": moved["transfer_accuracy"],
                                   "reads_only_within_L": moved["reads_only"]})
        for length in sorted({c["length"] for c in mine_cells}):
            _rank([c for c in mine_cells if c["length"] == length and c["ranked"]], rows, length)
        out += mine_cells
    return out


def run_cells(probe: dict) -> list[dict]:
    """One record's probe (its ``passkey``: posbench/evaluation/passkey.py ``record``) as :func:`cells` counts it, one dict per
    probe length, in length order: ``length``, ``n``, ``correct``, ``accuracy`` with its Wilson 95% interval
    (``ci_low``, ``ci_high``), ``gain``, ``within_L`` and ``valid`` (one row: nothing ranked or tested)."""
    return cells([{"passkey": probe, "setting": "", "order": 0, "seed": probe["settings"].get("seed")}])


def table(probe: dict) -> str:
    """One record's probe as a terminal table: per probe length, trials, keys retrieved, exact-match accuracy with
    its Wilson 95% interval and the mean retrieval gain; then the accuracy within L against the probe's threshold."""
    s, rows = probe["settings"], run_cells(probe)
    keys = s.get("keys", "frequent")  # (a record from before eval.passkey.keys drew frequent words)
    moved = s.get("transfer", "none") != "none"
    lines = [f"passkey retrieval ({s.get('split', 'validation')} split; key of {s['key_length']} tokens from "
             f"{s['key_vocab']} {KEY_KINDS.get(keys, keys)}; {s['trials']} trials × {len(s['depths'])} depths per "
             "length): exact match of the key, Wilson 95% interval; gain: the key's log-probability minus the "
             "control's, nats/token" + (f"; transfer: the same windows with keys of {s['transfer_key_vocab']} "
                                        f"{KEY_KINDS.get(s['transfer'], s['transfer'])}" if moved else ""),
             f"{'length':>8} {'trials':>7} {'correct':>8} {'accuracy':>9} {'95% interval':>16} {'gain':>8}"
             + (f" {'transfer':>9} {'95% interval':>16} {'gain':>8}" if moved else "")]
    for c in rows:
        ci = f"[{c['ci_low']:.0%}, {c['ci_high']:.0%}]"
        line = f"{c['length']:>8} {c['n']:>7} {c['correct']:>8} {c['accuracy']:>9.0%} {ci:>16} {c['gain']:>+8.3f}"
        if moved and c["transfer_accuracy"] is not None:
            ci = f"[{c['transfer_ci_low']:.0%}, {c['transfer_ci_high']:.0%}]"
            line += f" {c['transfer_accuracy']:>9.0%} {ci:>16} {c['transfer_gain']:>+8.3f}"
        lines.append(line)
    within = rows[0]["within_L"] if rows else None
    if within is None:
        lines.append(f"no probe length <= L={s['train_length']}: retrieval within L is not measured")
    else:
        lines.append(f"within L={s['train_length']}: {within:.0%} (threshold {s['threshold']:.0%}): "
                     + ("retrieves within L" if rows[0]["valid"] else "does not retrieve within L")
                     + (f"; {rows[0]['within_L_transfer']:.0%} on the transfer keys: " + transfer_note(s, rows[0])
                        if moved and rows[0]["within_L_transfer"] is not None else ""))
    return "\n".join(lines)


def transfer_note(settings: dict, cell: dict) -> str:
    """The transfer rule's verdict on a row within L in words: "reads trained keys only" (or "reads digits only" where
    the probe's keys are not the kind the run trained on), else "reads the transfer keys too"."""
    if not cell["reads_only_within_L"]:
        return "reads the transfer keys too" if cell["within_L_transfer"] else "reads no key of either kind"
    keys = settings.get("keys", "frequent")
    return ("reads trained keys only" if settings.get("trained_keys") == keys
            else f"reads {KEY_KINDS.get(keys, keys)} only")


def _rank(column: list[dict], rows: dict[str, dict], length: int) -> None:
    """Mark the best cell of one length and test every other against it (see :func:`cells`)."""
    if len(column) < 2 or max(c["accuracy"] for c in column) == 0:  # (nothing retrieved: nothing to rank)
        return
    best = max(column, key=lambda c: c["accuracy"])
    best["best"] = best["star"] = True

    def by_window(setting):
        return {key: _rate([o["correct"] for o in seeds.values()]) for key, seeds in rows[setting]["windows"].items()
                if key[0] == length}

    theirs = by_window(best["setting"])
    for c in column:
        if c is best:
            continue
        mine = by_window(c["setting"])
        shared = mine.keys() & theirs.keys()
        b = sum(theirs[key] > mine[key] for key in shared)
        d = sum(mine[key] > theirs[key] for key in shared)
        c["p_value"] = stats.mcnemar_exact(b, d) if shared else None
        c["star"] = c["p_value"] is not None and c["p_value"] >= stats.ALPHA
        c["untested"] = not shared  # (no window shared with the best: †)


def by_distance(records: list[dict]) -> dict[str, tuple[list, list]]:
    """{row label: (bin centres, accuracy)} of the first probe table: exact-match accuracy against needle-to-query
    distance in units of the row's L, binned by :data:`DISTANCE_BINS` (a bin's centre: the mean distance of its
    trials), every probe length and seed pooled."""
    out = {}
    for setting, row in next(iter(groups(records).values()), {}).items():
        bins = defaultdict(list)
        for seeds in row["windows"].values():
            for t in seeds.values():
                x = t["distance"] / row["L"]
                i = next((j for j in range(len(DISTANCE_BINS) - 1) if x <= DISTANCE_BINS[j + 1]), len(DISTANCE_BINS) - 1)
                bins[i].append((x, t["correct"]))
        out[setting] = ([statistics.fmean(x for x, _ in bins[i]) for i in sorted(bins)],
                        [statistics.fmean(c for _, c in bins[i]) for i in sorted(bins)])
    return out


def by_depth(records: list[dict]) -> dict[str, tuple[list, list, list]]:
    """{row label: (depths, lengths, accuracy[depth][length])} of the first probe table: a heatmap's grid (NaN where
    the row has no trial)."""
    out = {}
    for setting, row in next(iter(groups(records).values()), {}).items():
        depths = sorted({key[1] for key in row["windows"]})
        lengths = sorted({key[0] for key in row["windows"]})
        grid = [[_mean([o["correct"] for key, seeds in row["windows"].items() if key[:2] == (n, d) for o in seeds.values()])
                 for n in lengths] for d in depths]
        out[setting] = (depths, lengths, grid)
    return out


def _mean(values: list) -> float:
    return statistics.fmean(values) if values else math.nan


def probe_curves(records: list[dict], kind: str = "accuracy") -> dict[str, dict[int, tuple[list, list]]]:
    """{row label: {probe length: (training tokens, accuracy)}} of the records that probed during training
    (``probe_curve``: ``eval.probe_every``), the accuracy at each step the mean over the row's seeds; {} when none did.
    ``kind="transfer"``: the transfer control's accuracy (rows that probed without one have no curve)."""
    points = defaultdict(lambda: defaultdict(list))
    order = {}
    for rec in records:
        for row in rec.get("probe_curve") or []:
            order.setdefault(rec["setting"], rec["order"])
            for length, acc in (row.get(kind) or {}).items():
                points[(rec["setting"], int(length))][row["tokens"]].append(acc)
    out = {}
    for (setting, length), by_tokens in sorted(points.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        tokens = sorted(by_tokens)
        out.setdefault(setting, {})[length] = (tokens, [statistics.fmean(by_tokens[n]) for n in tokens])
    return out
