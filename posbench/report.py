"""Many runs' results folded into tables and plots (docs/design.md §8).

``posbench report FOLDER...`` (and :class:`ReportCallback` at the end of every multirun) folds the records under
the folders (``results.json`` and ``eval-*.json``, written by :mod:`posbench.results`) into:

* ``report.md`` — one table per evaluation setting (protocol, stride, split, token budget, lengths); rows =
  scheme and every other setting that differs between runs, columns = evaluation lengths, cells =
  exp(mean NLL over seeds) ± std over seeds of the per-seed perplexity, ★ where a cell is the best or not
  significantly worse (:mod:`posbench.stats`), and ppl(longest)/ppl(L); the settings held fixed; skipped runs;
* ``report.csv`` — the same numbers and tests, long format;
* ``ppl_vs_length.png`` and ``loss_vs_position.png``, of one evaluation setting (validation split and the
  nonoverlapping protocol when present).

    posbench report multirun/2026-11-21/10-00-00 [--out DIR]
"""

from __future__ import annotations

import csv
import json
import logging
from collections import Counter, defaultdict
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from posbench import plots, stats
from posbench.config import upgrade
from posbench.positional import variant_label
from posbench.results import READABLE, split_text

log = logging.getLogger("posbench")
REPORT_COLUMNS = ["table", "setting", "protocol", "stride", "split", "scored_split", "max_tokens", "lengths", "length",
                  "ppl", "ppl_std", "nll_mean", "nll_std", "seeds", "best", "test", "p_value", "ci_low", "ci_high",
                  "significantly_worse"]
IGNORED = ("seed", "eval.", "data.cache_dir", "data.num_proc", "train.device", "train.threads", "train.log_every",
           "train.checkpoint_every", "train.keep_checkpoints", "resume", "wandb.")  # never change a result
TITLE_KEYS = ("eval.protocol", "eval.stride", "eval.split", "eval.max_tokens", "eval.lengths")  # in table titles


class ReportError(ValueError):
    """Nothing to report (no folder, or no results in it); the CLI prints it as one line."""


# ---- which records, and how their settings differ ------------------------------------------------


def collect(folders: list[Path]) -> tuple[list[dict], list[str]]:
    """Every usable record under ``folders`` (sorted by path; its config upgraded to today's schema, and
    ``setting``/``order`` set: its row label and sort key), and one line per file skipped with the reason.

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
        for run in sorted(runs):
            files = sorted([*run.glob("results.json"), *run.glob("eval-*.json")])
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
                records.append(rec)
    if records:
        common = Counter(r["train_length"] for r in records).most_common(1)[0][0]
        skipped += [f"{r['path']}: train length L={r['train_length']} differs from L={common} of the other runs"
                    for r in records if r["train_length"] != common]
        records = [r for r in records if r["train_length"] == common]
    if not records:
        raise ReportError(f"no results in {', '.join(map(str, folders))}" + (f" ({len(skipped)} runs skipped)" if skipped else ""))
    return _dedupe(records, skipped)


def _dedupe(records: list[dict], skipped: list[str]) -> tuple[list[dict], list[str]]:
    """Set each record's row label and sort key; keep the first (by path) of records with the same label, seed
    and evaluation settings, and add a ``duplicate of <path>`` line to ``skipped`` for each other one."""
    label_keys, kept, first = settings(records)[0], [], {}
    for rec in sorted(records, key=lambda r: r["path"]):
        flat, label = _flat(rec["config"]), variant_label(rec["config"]["scheme"])
        keys = label_keys[label]
        rec["setting"] = ", ".join([label, *(f"{k}={_show(flat[k])}" for k in keys)])
        rec["order"] = (label, *(_value_key(json.loads(flat[k])) for k in keys))
        earlier = first.setdefault((rec["setting"], json.dumps(rec["seed"]), eval_settings(rec)), rec["path"])
        if earlier != rec["path"]:
            skipped.append(f"{rec['path']}: duplicate of {earlier}")
        else:
            kept.append(rec)
    return kept, skipped


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


def settings(records: list[dict]) -> tuple[dict[str, list[str]], dict[str, str], dict[str, list[str]], dict[str, dict]]:
    """How the records' configs differ (values as JSON text). Returns

    * label keys per variant label (:func:`posbench.positional.variant_label`: ``rope``, ``rope+yarn×16``):
      the scheme's own keys (``scheme.*``) that differ between its runs, then every other key with more than one value across all records (not seeds, evaluation
      or bookkeeping keys: :data:`IGNORED`);
    * the settings held fixed: keys every record has, with exactly one value (not the seed, the scheme or
      the evaluation settings of the table titles; null and [] left out);
    * the keys that differ but label no row (bookkeeping, ``eval.batch_tokens``), with their values;
    * per scheme, its ``scheme.*`` values that differ only between schemes, or that only some schemes have.

    A scheme's options are keys of the records of that scheme only: a key's values are those of the records
    that have it.
    """
    flats = [_flat(r["config"]) for r in records]  # upgraded configs: every key of the schema and of the scheme
    keys = sorted(set().union(*flats))
    values = {k: sorted({f[k] for f in flats if k in f}) for k in keys}
    by_scheme = defaultdict(list)  # by variant label: rope and rope+yarn×16 are two rows
    for rec, f in zip(records, flats):
        by_scheme[variant_label(rec["config"]["scheme"])].append(f)
    common = [k for k in keys if len(values[k]) > 1 and not k.startswith(("scheme.", *IGNORED))]
    own = {name: [k for k in keys if k.startswith("scheme.") and k != "scheme.name" and len({f.get(k) for f in group}) > 1]
           for name, group in by_scheme.items()}
    labels = {name: [*own[name], *common] for name in by_scheme}
    everywhere = {k for k in keys if all(k in f for f in flats)}  # not an option of some schemes only
    fixed = {k: v[0] for k, v in values.items() if len(v) == 1 and k in everywhere
             and k not in ("seed", "scheme.name", *TITLE_KEYS) and v[0] not in ("null", "[]")}
    varying = {k: v for k, v in values.items() if len(v) > 1 and k.startswith(IGNORED) and k not in ("seed", *TITLE_KEYS)}
    per_scheme = {name: {k: group[0][k] for k in keys if k.startswith("scheme.") and k != "scheme.name" and k in group[0]
                         and (len(values[k]) > 1 or k not in everywhere) and k not in own[name]}
                  for name, group in by_scheme.items()}
    return labels, fixed, varying, {name: v for name, v in per_scheme.items() if v}


def _show(text: str) -> str:
    value = json.loads(text)
    return value if isinstance(value, str) else text


def _value_key(value) -> tuple:
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
    """Long-format rows, one per (table, setting, length): tables in :func:`_preference` order (table 1 is
    plotted), settings in row order. Each row: ``table``, ``setting``, the evaluation settings, ``length``,
    and :func:`posbench.stats.summary` and :func:`posbench.stats.rank` of its seeds: ``ppl`` = exp(mean NLL
    over seeds) (perplexity), ``ppl_std`` (std over seeds of the per-seed perplexity), ``nll_mean``/``nll_std``
    (nats/token), ``seeds``, ``best`` and the test against the best row of its table at that length
    (``test``: welch | bootstrap | n/a | best, ``p_value``, ``ci_low``/``ci_high``, ``significantly_worse``)."""
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
            recs = sorted(recs, key=lambda r: _value_key(r["seed"]))
            for length in lengths:
                res = [next(r for r in rec["results"] if r["length"] == length) for rec in recs]
                cells[setting, length] = {**head, "setting": setting, "length": length, **stats.summary(
                    [r["nll"] for r in res], [(r["window_nll"], r["window_tokens"]) if "window_nll" in r and
                                              "window_tokens" in r else None for r in res])}
        for length in lengths:
            stats.rank([c for (_, n), c in cells.items() if n == length])
        rows += cells.values()
    return rows


def table_title(r: dict) -> str:
    """A table's evaluation settings in words, e.g. ``nonoverlapping, validation split, max_tokens=16384, lengths 128…2048``."""
    lengths = r["lengths"]
    doubling = len(lengths) > 2 and all(b == 2 * a for a, b in zip(lengths, lengths[1:]))
    return ", ".join([r["protocol"] + (f" (stride {r['stride']})" if r["protocol"] == "sliding" else ""), split_text(r),
                      "max_tokens=all (whole split)" if r["max_tokens"] is None else f"max_tokens={r['max_tokens']}",
                      (f"lengths {lengths[0]}…{lengths[-1]}" if doubling else
                       f"length{'s' * (len(lengths) > 1)} {', '.join(map(str, lengths))}")])


def _mark(r: dict) -> str:
    if r["test"] == "n/a":
        return " †"
    return "" if r["significantly_worse"] else " ★"


def tables(rows: list[dict], train_length: int) -> str:
    """Markdown tables, one per evaluation setting (its title states them): settings × lengths, cells
    exp(mean NLL) ± std of per-seed perplexity with ★/† marks, ppl(longest)/ppl(L) per row, seeds; a note on the tests."""
    out = []
    for table in sorted({r["table"] for r in rows}):
        sub = [r for r in rows if r["table"] == table]
        lengths = sub[0]["lengths"]
        base = train_length if train_length in lengths else lengths[0]
        ratio = len(lengths) > 1
        lines = [f"### {table}. {table_title(sub[0])}", "",
                 "| | " + " | ".join(map(str, lengths)) + (f" | ppl({lengths[-1]})/ppl({base})" if ratio else "") + " | seeds |",
                 "|---" * (len(lengths) + 2 + ratio) + "|"]
        settings_ = list(dict.fromkeys(r["setting"] for r in sub))
        compared = len(settings_) > 1  # one row: nothing to compare, no marks
        for setting in settings_:
            mine = {r["length"]: r for r in sub if r["setting"] == setting}
            cells = [f"{mine[n]['ppl']:.2f}" + (f" ± {mine[n]['ppl_std']:.2f}" if mine[n]["seeds"] > 1 else "")
                     + (_mark(mine[n]) if compared else "") for n in lengths]
            cells += [f"{mine[lengths[-1]]['ppl'] / mine[base]['ppl']:.2f}"] if ratio else []
            lines.append(f"| {setting} | " + " | ".join(cells) + f" | {mine[lengths[0]]['seeds']} |")
        out.append("\n".join([*lines, *(["", stats.note(sub)] if compared else [])]))
    return "\n\n".join(out)


# ---- files ---------------------------------------------------------------------------------------


def write_report(folders: list[Path], out: Path) -> tuple[str, list[dict], dict[str, Path]]:
    """Collect, fold, write report.md / report.csv / both PNGs into ``out``; return (tables, rows, images).

    Raises ReportError when there is nothing to report."""
    records, skipped = collect(folders)
    for line in skipped:
        log.warning("skipped %s", line)
    rows = fold(records)
    train_length = records[0]["train_length"]
    _, fixed, varying, per_scheme = settings(records)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "report.csv", "w", newline="") as f:
        w = csv.DictWriter(f, REPORT_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows({**r, "lengths": " ".join(map(str, r["lengths"]))} for r in rows)
    images = plots.draw(records, rows, out, train_length)
    seeds = sorted({r["seed"] for r in records}, key=_value_key)
    table_text = tables(rows, train_length)
    sections = [("Settings held fixed", [f"`{k}` = {v}" for k, v in fixed.items()]),
                ("Scheme settings", [f"{name}: " + ", ".join(f"`{k}` = {v}" for k, v in vals.items()) for name, vals in per_scheme.items()]),
                ("Settings that differ but do not split rows (bookkeeping; evaluation settings are in the table titles)",
                 [f"`{k}`: {', '.join(v)}" for k, v in varying.items()]),
                ("Skipped", skipped)]
    text = (f"# posbench report: perplexity by evaluation length (L = {train_length})\n\n"
            f"{len(records)} results from runs with seeds {seeds}. One table per evaluation setting; a row per scheme "
            "and per value of every other setting that differs between runs. Each cell is the perplexity exp(mean NLL "
            "over seeds), NLL in nats/token, ± the standard deviation over seeds of the per-seed perplexity; ★ marks "
            "the best cell of a column and those not significantly worse (the test is named under each table).\n\n"
            f"{table_text}\n\n![ppl vs length](ppl_vs_length.png)\n![loss vs position](loss_vs_position.png)\n"
            + "".join(f"\n## {head}\n\n" + "\n".join(f"- {line}" for line in lines) + "\n" for head, lines in sections
                      if lines or head == "Settings held fixed"))
    (out / "report.md").write_text(text)
    return table_text, rows, images


class ReportCallback(Callback):
    """Hydra callback: at the end of every multirun, write the report into the sweep folder, print its
    tables, and log the perplexity-vs-length chart and the PNGs to a wandb run of the sweep's group."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from posbench.tracking import Tracker

        sweep = Path(config.hydra.sweep.dir)
        try:
            table_text, rows, images = write_report([sweep], sweep)
        except ReportError as e:
            log.warning("no report: %s", e)
            return
        print(f"\n{table_text}\n\nreport: {sweep / 'report.md'}", flush=True)
        w = config.wandb
        tracker = Tracker(w.enabled, sweep, w.project, w.entity, name="report", group=sweep_group(sweep), job_type="report")
        tracker.log_report(plots.ppl_series(rows), images)
        tracker.finish()


def sweep_group(sweep_dir: Path) -> str:
    """The wandb group of a sweep: its folder's last two parts (``2026-11-21/10-00-00``)."""
    return "/".join(Path(sweep_dir).parts[-2:])
