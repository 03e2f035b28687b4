"""Many runs' records collected and compared: which records a report folds, how their settings differ, and the
cells it shows (docs/design.md §8). posbench/report/render.py renders what this module computes.

* :func:`collect` — every usable record under some folders (``results.json`` and ``eval-*.json``, written by
  posbench/evaluation/results.py), each skipped one with its reason, and its row: the full ``setting``, a short ``label`` and
  the settings that tell rows apart (``differs``);
* :func:`settings` — how the records' configs differ: the keys that label rows, the settings held fixed;
* :func:`fold` — one row per (table, setting, evaluation length): exp(mean NLL over seeds) ± std over seeds, the
  best cell of each column and the significance test against it (posbench/evaluation/stats.py);
* :func:`ppl_series`, :func:`position_curves` and :func:`labels` — what the report's plots and wandb draw.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from posbench.attention.temperature import ZERO_SHOT
from posbench.config.eval_checks import NEEDLE_FORMAT
from posbench.config.upgrade import upgrade
from posbench.evaluation import stats
from posbench.evaluation.results import READABLE, SUPERSEDED, run_label, temperature_label
from posbench.schemes import variant_label

IGNORED = ("seed", "eval.", "data.cache_dir", "data.num_proc", "train.device", "train.threads", "train.log_every",
           "train.checkpoint_every", "train.keep_checkpoints", "train.check_memory", "resume", "wandb.")  # never change a result
FT_KEYS = ("train.seq_len", "train.steps")  # what a fine-tuned run's label states (ft512×200)
TRICK_KEYS = ("model.attn_scale", "model.scale_length", "model.scale_beta", "model.scale_layers",  # what every label
              "train.random_positions", "train.pose",
              "model.layer_pattern", "model.window", "model.global_scheme", "model.qk_norm", "model.attn_sink")  # states
# (+rand2048, +LLLG(w32, G=nope); keys match as prefixes: model.window_kind, model.global_scheme.base, train.pose_chunks)
TITLE_KEYS = ("eval.protocol", "eval.stride", "eval.split", "eval.max_tokens", "eval.lengths")  # in table titles
LABEL_WIDTH = 40  # the longest short row label with values (``alibi, data.passkey_rate=0.1``), where it can be


class ReportError(ValueError):
    """Nothing to report (no folder, or no results in it); the CLI prints it as one line."""


# ---- which records, and how their settings differ ------------------------------------------------


def collect(folders: list[Path]) -> tuple[list[dict], list[str]]:
    """Every usable record under ``folders`` (sorted by path; its config upgraded to today's schema, and its row set:
    ``setting``, ``order``, ``label`` and ``differs``, see :func:`_dedupe`), and one line per file skipped with the reason.

    Skipped: a run folder with no results yet (still running, or stopped before evaluation), a run
    marked failed, a broken results file, a config that does not fit the schema, a run whose train
    length L differs from the most common L, and a duplicate: a record with the row label, seed and
    evaluation settings of an earlier one (by path). Raises ReportError for a missing folder or when
    nothing usable is found.
    """
    records, skipped = [], []
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise ReportError(f"{str(folder)!r} is not a folder; give run or sweep folders")
        runs = {p.parent.parent for p in folder.rglob(".hydra/config.yaml")} | {p.parent for p in folder.rglob("results.json")}
        for run in sorted(r for r in runs if SUPERSEDED not in r.relative_to(folder).parts):  # (asked for by name: kept)
            files, found = sorted([*run.glob("results.json"), *run.glob("eval-*.json")]), []
            if not files:
                skipped.append(f"{run}: no results yet (still running, or stopped before evaluation)")
            for path in files:
                try:
                    rec = json.loads(path.read_text())
                except (OSError, ValueError):
                    rec = None
                if isinstance(rec, dict) and rec.get("status") == "failed":
                    skipped.append(f"{path}: failed ({rec.get('error')})")
                    continue
                if not _well_formed(rec):
                    skipped.append(f"{path}: broken results file")
                    continue
                try:  # keys an older record lacks read as their defaults
                    rec["config"] = upgrade(rec["config"], rec["format"])
                except ValueError as e:
                    skipped.append(f"{path}: {e}")
                    continue
                rec["path"] = str(path)
                found.append(rec)
            _mark_reevaluations(found)
            records += found
    if records:
        common = Counter(map(origin_length, records)).most_common(1)[0][0]
        skipped += [f"{r['path']}: train length L={origin_length(r)} differs from L={common} of the other runs"
                    for r in records if origin_length(r) != common]
        records = [r for r in records if origin_length(r) == common]
    if not records:
        also = f" ({len(skipped)} runs skipped)" if skipped else ""
        raise ReportError(f"no results in {', '.join(map(str, folders))}{also}")
    return _dedupe(records, skipped)


def origin_length(rec: dict) -> int:
    """The train length L a record is compared at: its own, or, for a run started from a parent's weights, the L of
    the first run of its line (``lineage.origin_length``: posbench/training/lineage.py), so that a RoPE run fine-tuned at 4L
    is reported beside its parent and the parent's other fine-tunes."""
    return (rec.get("lineage") or {}).get("origin_length", rec["train_length"])


def _mark_reevaluations(run: list[dict]) -> None:
    """Set ``applied`` on each record of one run folder that ``posbench eval`` made with other scheme options or
    another temperature (``scheme_overrides``, ``model_overrides``): ``(the training record's run label with this
    record's remap, what the options add to it)``, e.g. ``("rope", "yarn×4")``, ``("rope", "floor_log")``,
    ``("rope@rerope(w16) ft512×200", "log_n_clipped")``, or the whole new variant where it does not extend the trained
    one (``("rope+yarn×2", "rope+yarn×2.5")``); without the training record, the label is left as it is."""
    trained = next((r for r in run if Path(r["path"]).name == "results.json"), None)
    for rec in run:
        if trained is None or not (rec.get("scheme_overrides") or rec.get("model_overrides")):
            continue
        base, new = variant_label(trained["config"]["scheme"]), variant_label(rec["config"]["scheme"])
        parts = [new[len(base) + 1:] if new.startswith(base + "+") else new] if new != base else []
        temperature = temperature_label(rec["config"])
        if temperature != temperature_label(trained["config"]):
            parts.append(temperature[1:] or "attn_scale=none")
        remapped = {**trained["config"], "eval": rec["config"].get("eval") or {}}  # the trained run, with this remap
        rec["applied"] = (run_label(remapped, trained.get("lineage")), "+".join(parts))


def label_of(rec: dict) -> str:
    """A record's run label (:func:`posbench.evaluation.results.run_label`: ``rope+yarn×16``, ``rope+yarn×4 ft512×200``,
    ``rope@rerope(w16)``); a re-evaluation with other scheme options or a temperature (``applied``:
    :func:`_mark_reevaluations`) names the run it was applied to, with its remap: ``rope (yarn×4 at eval)``,
    ``rope@rerope(w16) (log_n_clipped at eval)``."""
    if rec.get("applied"):
        return "{} ({} at eval)".format(*rec["applied"])
    return run_label(rec["config"], rec.get("lineage"))


def _label_order(rec: dict) -> tuple:
    """Rows by label, a fine-tuned run's by its method, then its step count as a number (ft512×50 before ft512×200)."""
    if not rec.get("lineage"):
        return (label_of(rec), -1)
    return (run_label(rec["config"], rec["lineage"], steps=False), rec["config"]["train"]["steps"])


def _dedupe(records: list[dict], skipped: list[str]) -> tuple[list[dict], list[str]]:
    """Set each record's row: ``setting`` (its run label and its label keys' values: ``alibi, data.passkey_rate=0.1``),
    ``order`` (its sort key), ``differs`` ({key: value as text} of every key that labels some row, where the record's
    config has it: a fine-tuned row's ``train.seq_len`` too) and ``label`` (:func:`_short_labels`); keep the
    first (by path) of records with the same setting, seed and evaluation settings, and add a ``duplicate of <path>``
    line to ``skipped`` for each other one."""
    label_keys, kept, first = settings(records)[0], [], {}
    every = sorted({k for keys in label_keys.values() for k in keys})
    for rec in sorted(records, key=lambda r: r["path"]):
        flat, label = options(rec["config"]), label_of(rec)
        keys = label_keys[label]
        rec["differs"] = {k: _show(flat[k]) for k in every if k in flat}
        rec["setting"] = ", ".join([label, *(f"{k}={rec['differs'][k]}" for k in keys)])
        rec["order"] = (_label_order(rec), *(value_key(json.loads(flat[k])) for k in keys))
        earlier = first.setdefault((rec["setting"], json.dumps(rec["seed"]), eval_settings(rec)), rec["path"])
        if earlier != rec["path"]:
            skipped.append(f"{rec['path']}: duplicate of {earlier}")
        else:
            kept.append(rec)
    _short_labels(kept)
    return kept, skipped


def _short_labels(records: list[dict]) -> None:
    """Set each record's ``label``: its run label (:func:`label_of`), then, where rows of several settings share that
    run label, the values of the fewest settings that tell those rows apart (:func:`_telling`:
    ``rope, scheme.base=500.0``), shortened to fit :data:`LABEL_WIDTH` characters where that keeps them apart
    (:func:`_fitted`: ``rope, base=500.0``). The other settings that differ between runs are the report's legend
    tables (``differs``)."""
    groups = defaultdict(dict)
    for rec in sorted(records, key=lambda r: r["order"]):
        groups[label_of(rec)].setdefault(rec["setting"], rec["differs"])
    short = {}
    for name, rows in groups.items():
        keys = _telling(rows)
        short.update(zip(rows, _fitted(name, [[(k, d.get(k, "–")) for k in keys] for d in rows.values()])))
    for rec in records:
        rec["label"] = short[rec["setting"]]


def _telling(rows: dict[str, dict]) -> list[str]:
    """The fewest keys (chosen greedily, each the one that tells most rows apart, kept in the rows' key order) whose
    values tell the rows (``{setting: {key: value}}``) apart; [] for one row."""
    every = [k for k in dict.fromkeys(k for d in rows.values() for k in d) if len({d.get(k) for d in rows.values()}) > 1]
    chosen = []
    while len({tuple(d.get(k) for k in chosen) for d in rows.values()}) < len(rows) and len(chosen) < len(every):
        chosen.append(max((k for k in every if k not in chosen),
                          key=lambda k: len({tuple(d.get(c) for c in [*chosen, k]) for d in rows.values()})))
    return [k for k in every if k in chosen]


def _fitted(name: str, parts: list[list[tuple[str, str]]]) -> list[str]:
    """Each row's label, ``name`` and its ``key=value`` parts: with full keys when every label fits
    :data:`LABEL_WIDTH`, else with the keys' last names (``base=500.0``), else with values cut to 10 characters
    (``…``), whichever first fits with the labels still distinct; full keys when none does."""
    def cut(value: str) -> str:
        return value if len(value) <= 10 else value[:9] + "…"

    forms = [lambda k, v: f"{k}={v}", lambda k, v: f"{k.rsplit('.', 1)[-1]}={v}",
             lambda k, v: f"{k.rsplit('.', 1)[-1]}={cut(v)}"]
    for form in forms:
        labels = [", ".join([name, *(form(k, v) for k, v in row)]) for row in parts]
        if len(set(labels)) == len(labels) and all(len(label) <= LABEL_WIDTH for label in labels):
            return labels
    return [", ".join([name, *(f"{k}={v}" for k, v in row)]) for row in parts]


RECORD_KEYS = ("format", "scheme", "train_length", "protocol", "stride", "split", "seed", "config", "results")
ROW_KEYS = ("length", "ppl", "nll", "nll_by_position")


def _well_formed(rec) -> bool:
    """A results record of a :data:`READABLE` format with every key the report reads."""
    return (isinstance(rec, dict) and all(k in rec for k in RECORD_KEYS) and rec["format"] in READABLE
            and isinstance(rec["config"], dict) and isinstance(rec["results"], list) and len(rec["results"]) > 0
            and all(isinstance(r, dict) and all(k in r for k in ROW_KEYS) for r in rec["results"]))


def eval_settings(rec: dict) -> tuple:
    """What a record's numbers depend on besides the model: (protocol, stride (sliding only), split,
    scored_split (the split when absent), eval.max_tokens (None: the whole split), evaluation lengths)."""
    return (rec["protocol"], rec["stride"] if rec["protocol"] == "sliding" else None, rec["split"],
            rec.get("scored_split") or rec["split"], rec["config"]["eval"]["max_tokens"],
            tuple(sorted(r["length"] for r in rec["results"])))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": json.dumps(v)})
    return out


def _probes(c: dict) -> list:
    return c["eval"].get("probes") or []


def _needles(c: dict) -> bool:
    return (c["data"].get("passkey_rate") or 0) > 0


IDLE = (  # (option or option prefix, whether a config uses that option): a run without the other does not use it
    ("eval.passkey.", lambda c, k: "passkey" in _probes(c) or (_needles(c) and k.rsplit(".", 1)[-1] in NEEDLE_FORMAT)),
    ("eval.context.", lambda c, k: "context" in _probes(c)),
    ("data.passkey_pairs", lambda c, k: _needles(c)),
    ("data.copy_until", lambda c, k: (c["data"].get("copy_rate") or 0) > 0),
    ("train.pose_chunks", lambda c, k: bool(c["train"].get("pose"))),
    ("model.qk_norm_", lambda c, k: c["model"].get("qk_norm", "none") != "none"),
    ("model.window_kind", lambda c, k: bool(c["model"].get("window"))),
    ("model.scale_beta", lambda c, k: c["model"].get("attn_scale", "none") in ("floor_log", "floor_log_n")),
    ("model.scale_layers", lambda c, k: c["model"].get("attn_scale", "none") in ZERO_SHOT),
    ("scheme.beta_", lambda c, k: c["scheme"].get("scaling") == "yarn"),
    ("scheme.yarn_ramp", lambda c, k: c["scheme"].get("scaling") == "yarn"),
    ("scheme.low_freq_factor", lambda c, k: c["scheme"].get("scaling") == "llama3"),
    ("scheme.high_freq_factor", lambda c, k: c["scheme"].get("scaling") == "llama3"),
)
PARTLY = " (the runs that use it)"  # after a value held fixed over the runs that use the option, not over every run


def options(config: dict) -> dict:
    """A record's config flattened (``{"train.lr": "0.002"}``, values as JSON text), without the options it does not
    use (:data:`IDLE`: the passkey probe's options of a run that neither ran it nor trained with needles, …): what its
    numbers depend on."""
    return {k: v for k, v in _flat(config).items() if all(used(config, k) for prefix, used in IDLE if k.startswith(prefix))}


def settings(records: list[dict]) -> tuple[dict[str, list[str]], dict[str, str], dict[str, list[str]], dict[str, dict]]:
    """How the records' configs differ (values as JSON text). Returns

    * label keys per run label (:func:`label_of`: ``rope``, ``rope+yarn×16``, ``rope+yarn×4 ft512×200``):
      the scheme's own keys (``scheme.*``) that differ between its runs, then every other key with more than one
      value across all records (not seeds, evaluation
      or bookkeeping keys: :data:`IGNORED`; not the tricks every label states: :data:`TRICK_KEYS`; for a fine-tuned
      run's label, not what it states: :data:`FT_KEYS`);
    * the settings held fixed: keys every record has, with exactly one value over the records that use it
      (:func:`options`; followed by :data:`PARTLY` where some do not; not the seed, the scheme or the evaluation
      settings of the table titles; null and [] left out);
    * the keys that differ but label no row (bookkeeping, ``eval.batch_tokens``), with their values;
    * per scheme, its ``scheme.*`` values that differ only between schemes, or that only some schemes have.

    A scheme's options are keys of the records of that scheme only: a key's values are those of the records
    that have it.
    """
    flats = [options(r["config"]) for r in records]  # upgraded configs: every key of the schema and of the scheme
    keys = sorted(set().union(*flats))
    values = {k: sorted({f[k] for f in flats if k in f}) for k in keys}
    by_scheme, fine_tuned = defaultdict(list), set()  # by run label: rope and rope+yarn×16 are two rows
    for rec, f in zip(records, flats):
        by_scheme[label_of(rec)].append(f)
        if rec.get("lineage"):
            fine_tuned.add(label_of(rec))
    common = [k for k in keys if len(values[k]) > 1 and not k.startswith(("scheme.", *IGNORED, *TRICK_KEYS))]
    own = {name: [k for k in keys if k.startswith("scheme.") and k != "scheme.name" and len({f.get(k) for f in group}) > 1]
           for name, group in by_scheme.items()}
    labels = {name: [*own[name], *(k for k in common if name not in fine_tuned or k not in FT_KEYS)] for name in by_scheme}
    raw = [_flat(r["config"]) for r in records]
    everywhere = {k for k in keys if all(k in f for f in raw)}  # not an option of some schemes only
    fixed = {k: v[0] + ("" if all(k in f for f in flats) else PARTLY) for k, v in values.items() if len(v) == 1
             and k in everywhere and k not in ("seed", "scheme.name", *TITLE_KEYS) and v[0] not in ("null", "[]")}
    varying = {k: v for k, v in values.items() if len(v) > 1 and k.startswith(IGNORED) and k not in ("seed", *TITLE_KEYS)}
    per_scheme = {name: {k: group[0][k] for k in keys if k.startswith("scheme.") and k != "scheme.name" and k in group[0]
                         and (len(values[k]) > 1 or k not in everywhere) and k not in own[name]}
                  for name, group in by_scheme.items()}
    return labels, fixed, varying, {name: v for name, v in per_scheme.items() if v}


def _show(text: str) -> str:
    value = json.loads(text)
    return value if isinstance(value, str) else text


def value_key(value) -> tuple:
    """Sort key comparing values as values: None, then numbers numerically (2 before 10), strings, the rest."""
    if value is None:
        return (0, 0.0, "")
    if isinstance(value, (bool, int, float)):
        return (1, float(value), "")
    return (2, 0.0, value) if isinstance(value, str) else (3, 0.0, json.dumps(value))


# ---- the numbers ---------------------------------------------------------------------------------


def _preference(group: tuple, n_records: int) -> tuple:
    """Tables (and the plots, of the first) in this order: validation split, nonoverlapping, most records,
    then the most tokens scored and the most lengths."""
    protocol, stride, split, scored, max_tokens, lengths = group
    return (split != "validation", protocol != "nonoverlapping", -n_records, max_tokens is not None, -(max_tokens or 0),
            -len(lengths), protocol, stride or 0, split, scored, lengths)


def fold(records: list[dict]) -> list[dict]:
    """Long-format rows, one per (table, setting, length): tables in :func:`_preference` order, settings in row order.
    Each row: ``table``, ``setting``, ``label`` and ``differs`` (:func:`_dedupe`), the evaluation settings, ``length``,
    its run's training (:func:`_budget`: ``train_length``, ``origin_length``, ``method``, tokens), and
    :func:`posbench.evaluation.stats.summary` and :func:`posbench.evaluation.stats.rank` of its seeds: ``ppl`` = exp(mean NLL
    over seeds) (perplexity), ``ppl_std`` (std over seeds of the per-seed perplexity), ``nll_mean``/``nll_std``
    (nats/token), ``seeds``, ``best`` and the test against the best row of its table at that length
    (``reference``/``reference_label``: that row's setting and label; ``test``: welch | bootstrap | n/a | best,
    ``p_value``, ``ci_low``/``ci_high``, ``significantly_worse``, ``windows``)."""
    groups = defaultdict(lambda: defaultdict(list))
    for rec in records:
        groups[eval_settings(rec)][(rec["order"], rec["setting"])].append(rec)
    ranked = sorted(groups, key=lambda g: _preference(g, sum(map(len, groups[g].values()))))
    rows = []
    for table, group in enumerate(ranked, 1):
        protocol, stride, split, scored, max_tokens, lengths = group
        head = {"table": table, "protocol": protocol, "stride": stride, "split": split, "scored_split": scored,
                "max_tokens": max_tokens, "lengths": list(lengths), "eval_settings": group}
        cells = {}
        for (_, setting), recs in sorted(groups[group].items()):
            recs = sorted(recs, key=lambda r: value_key(r["seed"]))
            for length in lengths:
                res = [next(r for r in rec["results"] if r["length"] == length) for rec in recs]
                cells[setting, length] = {**head, "setting": setting, "label": recs[0]["label"], "folders": [
                                              str(Path(rec["path"]).resolve().parent) for rec in recs
                                              if Path(rec["path"]).name == "results.json"],
                                          "differs": recs[0]["differs"], "length": length, **_budget(recs[0]), **stats.summary(
                    [r["nll"] for r in res], [(r["window_nll"], r["window_tokens"]) if "window_nll" in r and
                                              "window_tokens" in r else None for r in res])}
        for length in lengths:
            column = [c for (_, n), c in cells.items() if n == length]
            stats.rank(column)
            best = next(c for c in column if c["best"])
            for c in column:
                c.update(reference=best["setting"], reference_label=best["label"])
        rows += cells.values()
    return rows


def _budget(rec: dict) -> dict:
    """A record's training: ``train_length`` (its own train length ``train.seq_len``, tokens), ``origin_length``
    (:func:`origin_length`: its line's first), ``train_tokens`` (its own), and for a fine-tuned run its ``method`` (its
    label without the step count: ``rope+yarn×4 ft512``), ``total_train_tokens`` (its parent's line's + its own) and
    ``parent`` (the parent's run folder, resolved)."""
    lineage = rec.get("lineage")
    return {"train_length": rec["config"]["train"]["seq_len"], "origin_length": origin_length(rec),
            "train_tokens": rec.get("train_tokens"), "total_train_tokens": rec.get("total_train_tokens"),
            "method": run_label(rec["config"], lineage, steps=False) if lineage else None,
            "parent": str(Path(lineage["folder"]).resolve()) if lineage and lineage.get("folder") else None}


# ---- what the plots draw --------------------------------------------------------------------------


def ppl_series(rows: list[dict]) -> dict[str, tuple[list, list]]:
    """{row label: (lengths, perplexity exp(mean NLL))} of the first table (validation split, nonoverlapping when
    present): wandb's chart."""
    first = min(r["table"] for r in rows)
    series = defaultdict(lambda: ([], []))
    for r in sorted((r for r in rows if r["table"] == first), key=lambda r: r["length"]):
        series[r["label"]][0].append(r["length"])
        series[r["label"]][1].append(r["ppl"])
    return dict(series)


def _at_longest(rows: list[dict]) -> list[dict]:
    """The plotted table's rows (the first: validation split, nonoverlapping when present) at its longest length."""
    first = min(r["table"] for r in rows)
    longest = max(r["length"] for r in rows if r["table"] == first)
    return [r for r in rows if r["table"] == first and r["length"] == longest]


def finetune_series(rows: list[dict]) -> dict[str, tuple[list, list]]:
    """{method: (fine-tuning tokens, perplexity at the longest evaluation length)} of the plotted table's fine-tuned
    rows (``method`` set by :func:`fold`), in token order: how each method improves with its budget; {} without any."""
    series = defaultdict(lambda: ([], []))
    for r in sorted((r for r in _at_longest(rows) if r.get("method")), key=lambda r: r["train_tokens"] or 0):
        series[r["method"]][0].append(r["train_tokens"] or 0)
        series[r["method"]][1].append(r["ppl"])
    return dict(series)


def finetune_parents(rows: list[dict]) -> dict[str, float]:
    """{row label: perplexity at the longest evaluation length} of the plotted table's rows that are the parent of
    one of its fine-tuned rows (a row's run folder is a fine-tuned row's ``parent``): the weights before fine-tuning."""
    plotted = _at_longest(rows)
    parents = {r["parent"] for r in plotted if r.get("parent")}
    return {r["label"]: r["ppl"] for r in plotted if not r.get("method") and parents & set(r.get("folders", []))}


def position_curves(records: list[dict], rows: list[dict], table: int) -> dict[tuple[str, int], tuple[list, list]]:
    """{(setting, longest length): (bin centres, NLL)} of one table's evaluation setting: each setting's NLL by token
    position (nats/token, 1-based bin centres) at its longest evaluation length T, mean over seeds.

    Under the sliding protocol (stride S) only the first window scores positions before T − S (0-based), so only the
    bins reaching T − S are kept, each centred on its part from T − S: positions every window scores. A bin that
    straddles T − S still averages its first window's earlier positions in, one window against all the others'."""
    group = next(r["eval_settings"] for r in rows if r["table"] == table)
    protocol, stride = group[:2]
    runs = defaultdict(list)
    for rec in records:
        if eval_settings(rec) == group:
            longest = max(rec["results"], key=lambda r: r["length"])
            runs[(rec["order"], rec["setting"], longest["length"])].append(longest["nll_by_position"])
    curves = {}
    for (_, setting, length), by_position in sorted(runs.items()):
        edges, first = by_position[0]["position"], length - stride if protocol == "sliding" else 0
        bins = [(i, max(a, first), b) for i, (a, b) in enumerate(zip(edges, [*edges[1:], length])) if b > first]
        curves[setting, length] = ([(a + b + 1) / 2 for _, a, b in bins],  # bin centres, 1-based positions
                                   [statistics.fmean(r["nll"][i] for r in by_position) for i, _, _ in bins])
    return curves


def labels(records: list[dict]) -> dict[str, str]:
    """{setting: short row label} of every record, in row order: one colour (and line style) each, the same in every plot."""
    return {s: label for _, s, label in sorted({(r["order"], r["setting"], r["label"]) for r in records})}
