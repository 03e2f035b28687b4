"""How the reported records' settings differ, and the rows they make (docs/design.md §8): posbench/report/records.py
names each record's row with them, posbench/report/render.py lists them.

* :func:`settings` — how the records' configs differ: the keys that label rows, the settings held fixed, the
  bookkeeping that differs, each scheme's own values; :func:`options` — the options a record's numbers depend on;
* :func:`name_rows` and :func:`short_labels` — each record's row: its full ``setting``, sort ``order``, the settings
  that tell rows apart (``differs``) and its short ``label`` (:func:`label_of`: its run label, then the fewest values
  that tell apart the rows that share it);
* :func:`eval_settings` and :func:`value_key` — what a record's numbers depend on besides the model; values sorted as
  values;
* :func:`legend` — what a table's short row labels stand for, as markdown.
"""

from __future__ import annotations

import json
from collections import defaultdict

from posbench.attention.temperature import ZERO_SHOT
from posbench.config.eval_checks import NEEDLE_FORMAT
from posbench.evaluation.results import run_label

IGNORED = ("seed", "eval.", "data.cache_dir", "data.num_proc", "train.device", "train.threads", "train.log_every",
           "train.checkpoint_every", "train.keep_checkpoints", "train.check_memory", "resume", "wandb.")  # never change a result
FT_KEYS = ("train.seq_len", "train.steps")  # what a fine-tuned run's label states (ft512×200)
TRICK_KEYS = ("model.attn_scale", "model.scale_length", "model.scale_beta", "model.scale_layers",  # what every label
              "train.random_positions", "train.pose",
              "model.layer_pattern", "model.window", "model.global_scheme", "model.qk_norm", "model.attn_sink")  # states
# (+rand2048, +LLLG(w32, G=nope); keys match as prefixes: model.window_kind, model.global_scheme.base, train.pose_chunks)
TITLE_KEYS = ("eval.protocol", "eval.stride", "eval.split", "eval.max_tokens", "eval.lengths")  # in table titles
LABEL_WIDTH = 40  # the longest short row label with values (``alibi, data.passkey_rate=0.1``), where it can be


# ---- each record's row -------------------------------------------------------------------------


def label_of(rec: dict) -> str:
    """A record's run label (:func:`posbench.evaluation.results.run_label`: ``rope+yarn×16``, ``rope+yarn×4 ft512×200``,
    ``rope@rerope(w16)``); a re-evaluation with other scheme options or a temperature (``applied``: set by
    posbench/report/records.py) names the run it was applied to, with its remap: ``rope (yarn×4 at eval)``,
    ``rope@rerope(w16) (log_n_clipped at eval)``; a pretrained checkpoint's evaluation, its own label
    (``SmolLM2-135M-Instruct (yarn×4 at eval)``: ``posbench.evaluation.results.pretrained_label``)."""
    if rec.get("checkpoint_label"):
        return rec["checkpoint_label"]
    if rec.get("applied"):
        return "{} ({} at eval)".format(*rec["applied"])
    return run_label(rec["config"], rec.get("lineage"))


def _label_order(rec: dict) -> tuple:
    """Rows by label, a fine-tuned run's by its method, then its step count as a number (ft512×50 before ft512×200)."""
    if not rec.get("lineage"):
        return (label_of(rec), -1)
    return (run_label(rec["config"], rec["lineage"], steps=False), rec["config"]["train"]["steps"])


def name_rows(records: list[dict]) -> None:
    """Set each record's row: ``setting`` (its run label and its label keys' values: ``alibi, data.passkey_rate=0.1``),
    ``order`` (its sort key) and ``differs`` ({key: value as text} of every key that labels some row, where the
    record's config has it: a fine-tuned row's ``train.seq_len`` too); its ``label`` is :func:`short_labels`'s."""
    label_keys = settings(records)[0]
    every = sorted({k for keys in label_keys.values() for k in keys})
    for rec in records:
        flat, label = options(rec["config"]), label_of(rec)
        keys = label_keys[label]
        rec["differs"] = {k: _show(flat[k]) for k in every if k in flat}
        rec["setting"] = ", ".join([label, *(f"{k}={rec['differs'][k]}" for k in keys)])
        rec["order"] = (_label_order(rec), *(value_key(json.loads(flat[k])) for k in keys))


def short_labels(records: list[dict]) -> None:
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


def eval_settings(rec: dict) -> tuple:
    """What a record's numbers depend on besides the model: (protocol, stride (sliding only), split,
    scored_split (the split when absent), eval.max_tokens (None: the whole split), evaluation lengths)."""
    return (rec["protocol"], rec["stride"] if rec["protocol"] == "sliding" else None, rec["split"],
            rec.get("scored_split") or rec["split"], rec["config"]["eval"]["max_tokens"],
            tuple(sorted(r["length"] for r in rec["results"])))


# ---- how their settings differ -------------------------------------------------------------------


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": json.dumps(v)})
    return out


def _probes(c: dict) -> list:
    return c["eval"].get("probes") or []


def _needles(c: dict) -> bool:
    return (c["data"].get("passkey_rate") or 0) > 0


IDLE = (  # (option or option prefixes, whether a config uses that option): a run without the other does not use it
    ("eval.passkey.", lambda c, k: "passkey" in _probes(c) or (_needles(c) and k.rsplit(".", 1)[-1] in NEEDLE_FORMAT)),
    ("eval.context.", lambda c, k: "context" in _probes(c)),
    ("data.passkey_pairs", lambda c, k: _needles(c)),
    ("data.copy_until", lambda c, k: (c["data"].get("copy_rate") or 0) > 0),
    ("train.pose_chunks", lambda c, k: bool(c["train"].get("pose"))),
    ("model.qk_norm_", lambda c, k: c["model"].get("qk_norm", "none") != "none"),
    ("model.window_kind", lambda c, k: bool(c["model"].get("window"))),
    ("model.scale_beta", lambda c, k: c["model"].get("attn_scale", "none") in ("floor_log", "floor_log_n")),
    ("model.scale_layers", lambda c, k: c["model"].get("attn_scale", "none") in ZERO_SHOT),
    (("scheme.beta_", "scheme.yarn_ramp"), lambda c, k: c["scheme"].get("scaling") == "yarn"),
    (("scheme.low_freq_factor", "scheme.high_freq_factor"), lambda c, k: c["scheme"].get("scaling") == "llama3"),
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


def legend(sub: list[dict]) -> list[str]:
    """What the short row labels of one table stand for: a table of the settings that differ between its rows (a
    column per key, "–" where a row's scheme has no such option) and a line of those its rows share; [] when no
    setting tells the reported runs apart."""
    rows = {r["label"]: r["differs"] for r in sub}
    keys = list(dict.fromkeys(k for differs in rows.values() for k in differs))
    if not keys:
        return []
    varying = [k for k in keys if len({d.get(k) for d in rows.values()}) > 1]
    shared = [f"`{k}` = {v}" for k, v in next(iter(rows.values())).items() if k not in varying]
    lines = [""]
    if varying:
        lines += ["| row | " + " | ".join(f"`{k}`" for k in varying) + " |", "|---" * (len(varying) + 1) + "|",
                  *(f"| {label} | " + " | ".join(d.get(k, "–") for k in varying) + " |" for label, d in rows.items())]
    if shared:
        lines += [*([""] if varying else []), ("The rows of this table share " if len(rows) > 1 else
                                                f"{next(iter(rows))} has ") + ", ".join(shared)
                  + " (runs in the report's other tables have other values)."]
    return lines
