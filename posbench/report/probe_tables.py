"""The probes' tables of a report (docs/design.md §6.4, §6.5, §8): the passkey cells (posbench/evaluation/retrieval.py
``cells``) and the context-use cells (posbench/evaluation/context.py ``cells``) as markdown, one table per probe,
rows × probe lengths, with their columns for ``passkey.csv`` and ``context.csv``; posbench/report/render.py puts them
in ``report.md``.

    text = passkey_tables(cells, names)    # names: {setting: its row (``label``, ``differs``)}
"""

from __future__ import annotations

from posbench.evaluation import retrieval, stats
from posbench.report.settings import legend

PASSKEY_COLUMNS = ["table", "setting", "length", "n", "correct", "accuracy", "ci_low", "ci_high", "gain", "within_L", "valid",
                   "ranked", "best", "p_value", "star", "transfer_correct", "transfer_accuracy", "transfer_ci_low",
                   "transfer_ci_high", "transfer_gain", "reads_only", "within_L_transfer", "reads_only_within_L", "label"]


def passkey_tables(cells: list[dict], names: dict[str, dict] | None = None) -> str:
    """The passkey probe's tables (posbench/evaluation/retrieval.py), one per probe: rows × probe lengths, cells exact-match
    accuracy with its Wilson 95% interval and ★ (the column's best ranked row, or not significantly worse by the
    paired test) or † (untested), the accuracy within L and the mean gain at the longest length; a row below the
    threshold within L is marked and not ranked past L. ``names``: {setting: a perplexity row (``label``,
    ``differs``)}: rows by short label, with their :func:`legend` (None: by setting)."""
    out = []
    names = names or {}
    for table in sorted({c["table"] for c in cells}):
        sub = [c for c in cells if c["table"] == table]
        probe, lengths = sub[0]["settings"], sorted({c["length"] for c in sub})
        moved = any(c["transfer_accuracy"] is not None for c in sub)
        transfer = probe.get("transfer", "transfer")
        lines = [f"### P{table}. {probe_title(probe)}", "",
                 "| | " + " | ".join([*map(str, lengths), "within L", f"gain at {lengths[-1]}"]
                                     + [*(f"{n} {transfer}" for n in lengths), f"within L {transfer}"] * moved) + " |",
                 "|---" * (len(lengths) + 3 + (len(lengths) + 1) * bool(moved)) + "|"]
        for setting in dict.fromkeys(c["setting"] for c in sub):
            mine = {c["length"]: c for c in sub if c["setting"] == setting}
            first = next(iter(mine.values()))
            row = [f"{mine[n]['accuracy']:.0%} ({mine[n]['ci_low']:.0%}–{mine[n]['ci_high']:.0%})" + _probe_mark(mine[n])
                   if n in mine else "" for n in lengths]
            within = "–" if first["within_L"] is None else f"{first['within_L']:.0%}"
            label = _name(names, setting) + ("" if first["valid"] else " (does not retrieve within L)"
                                             if first["within_L"] is not None else " (no probe length ≤ L: not ranked past L)")
            label += f" ({retrieval.transfer_note(probe, first)})" if first["reads_only_within_L"] else ""
            gain = f"{mine[lengths[-1]]['gain']:+.2f}" if lengths[-1] in mine else ""
            moves = [*(_transfer_cell(mine.get(n)) for n in lengths), _share(first["within_L_transfer"])] * moved
            lines.append(f"| {label} | " + " | ".join([*row, within, gain, *moves]) + " |")
        n = max(c["n"] for c in sub)
        lines += ["", f"Exact match of the key, % of up to {n} trials per cell ({probe['trials']} per depth × "
                  f"{len(probe['depths'])} depths {list(probe['depths'])} per seed, the same windows for every row), with "
                  "the Wilson 95% interval (Wilson 1927; seeds pooled as trials). ★: the best ranked row of the column, or "
                  "not significantly worse than it by a paired sign test over the windows both were probed on (each "
                  "window's accuracy over the row's seeds; with one seed the exact McNemar test, McNemar 1947; two-sided "
                  f"p ≥ {stats.ALPHA}); †: no shared window, untested; no ★ where no ranked row retrieved a key. Within L: "
                  f"accuracy in the windows no longer than L; below {probe['threshold']:.0%} the row does not retrieve "
                  "within L and is not ranked past L. Gain: the key's mean log-probability (nats/token) minus the same "
                  "key's when the needle held another key (0: the context is not used)."]
        lines += [f"Transfer ({transfer}): the same windows with keys of {probe.get('transfer_key_vocab', '')} "
                  f"{retrieval.KEY_KINDS.get(transfer, transfer)}, a kind the run never trained on as keys; a row reads "
                  "its probe's keys only where, within L, the transfer accuracy is below half its own and the two Wilson "
                  "intervals do not overlap."] * moved
        out.append("\n".join(lines + _legend_of(names, sub)))
    return "\n\n".join(out)


def probe_title(probe: dict) -> str:
    """A passkey probe's settings in words: split, key, marker and seed."""
    keys = probe.get("keys", "frequent")
    share = f" ({probe['key_fraction']:.2%} of the split's tokens are key tokens)" if "key_fraction" in probe else ""
    return (f"{probe.get('split', 'validation')} split, key of {probe['key_length']} tokens from {probe['key_vocab']} "
            f"{retrieval.KEY_KINDS.get(keys, keys)}{share}, marker {probe['marker']!r}, probe seed {probe['seed']}")


def _name(names: dict[str, dict], setting: str) -> str:
    return names[setting]["label"] if setting in names else setting


def _legend_of(names: dict[str, dict], cells: list[dict]) -> list[str]:
    """The :func:`legend` of a probe table's rows (``cells`` with ``setting``), [] without ``names``."""
    return legend([names[s] for s in dict.fromkeys(c["setting"] for c in cells) if s in names])


CONTEXT_COLUMNS = ["table", "setting", "length", "windows", "seeds", "diff", "ci_low", "ci_high", "nll_full", "nll_short",
                   "label"]


def _nats(x: float) -> str:
    return f"{x:+.3f}".replace("-", "−")


def context_tables(cells: list[dict], names: dict[str, dict] | None = None) -> str:
    """The context-use probe's tables (posbench/evaluation/context.py ``cells``), one per probe (split, L, stride): rows ×
    evaluation lengths, cells the mean NLL difference past L with its bootstrap 95% interval, nats/token.
    ``names``: as :func:`passkey_tables`'s."""
    out = []
    names = names or {}
    for table in sorted({c["table"] for c in cells}):
        sub = [c for c in cells if c["table"] == table]
        s, lengths = sub[0]["settings"], sorted({c["length"] for c in sub})
        L, S = s["train_length"], s["stride"]
        lines = [f"### C{table}. {s.get('split', 'validation')} split, L = {L}, stride {S}", "",
                 "| | " + " | ".join(map(str, lengths)) + " | seeds |", "|---" * (len(lengths) + 2) + "|"]
        for setting in dict.fromkeys(c["setting"] for c in sub):
            mine = {c["length"]: c for c in sub if c["setting"] == setting}
            row = [f"{_nats(mine[n]['diff'])} ({_nats(mine[n]['ci_low'])} … {_nats(mine[n]['ci_high'])})" if n in mine
                   else "" for n in lengths]
            lines.append(f"| {_name(names, setting)} | " + " | ".join(row) + f" | {max(c['seeds'] for c in mine.values())} |")
        windows = ", ".join(f"{n}: {max(c['windows'] for c in sub if c['length'] == n)}" for n in lengths)
        lines += ["", f"Mean over windows of NLL_full − NLL_short (nats/token) for the tokens at positions ≥ L of each "
                  f"window: NLL_full with the token's whole left context in the window, NLL_short by a sliding window of "
                  f"L tokens with stride {S} (each token keeps {L - S + 1}…{L} tokens of context). Negative: the model "
                  "uses context beyond L; 0: it ignores it; positive: the longer context hurts. In brackets the "
                  f"percentile bootstrap 95% interval over windows ({s['bootstrap']} resamples, seed {s['seed']}); "
                  f"seeds pooled per window (the mean over a row's seeds). Windows per length: {windows}."]
        out.append("\n".join(lines + _legend_of(names, sub)))
    return "\n\n".join(out)


def _share(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def _transfer_cell(c: dict | None) -> str:
    """A passkey cell's transfer accuracy with its Wilson interval ("" where the row has no such cell, – where its
    trials have no transfer control)."""
    if c is None:
        return ""
    if c["transfer_accuracy"] is None:
        return "–"
    return f"{c['transfer_accuracy']:.0%} ({c['transfer_ci_low']:.0%}–{c['transfer_ci_high']:.0%})"


def _probe_mark(c: dict) -> str:
    """★ (best, or not significantly worse), † (ranked but untested: no window shared with the best), or nothing."""
    if c["star"]:
        return " ★"
    return " †" if c.get("untested") else ""


# ---- files ---------------------------------------------------------------------------------------
