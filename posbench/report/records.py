"""Which records a report folds (docs/design.md §8): :func:`collect` reads every usable record under some folders
(``results.json`` and ``eval-*.json``, written by posbench/evaluation/results.py), names each skipped one with its
reason, keeps the newest of the records of one setting (:func:`written`), sets each one's row
(posbench/report/settings.py) and finds each fine-tuned run's parent among them (:func:`orphans`: those it does not
find). posbench/report/compare.py folds them into cells and series.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from posbench.config.upgrade import upgrade
from posbench.evaluation.results import READABLE, SUPERSEDED, applied
from posbench.report.settings import eval_settings, name_rows, short_labels
from posbench.training.lineage import config_sha256


class ReportError(ValueError):
    """Nothing to report (no folder, or no results in it); the CLI prints it as one line."""


def collect(folders: list[Path]) -> tuple[list[dict], list[str]]:
    """Every usable record under ``folders`` (sorted by path; its config upgraded to today's schema, the hashes of its
    config as recorded and as upgraded (``hashes``), its row set: ``setting``, ``order``, ``label`` and ``differs``, see
    :func:`_dedupe`, and a fine-tuned run's ``parent``: :func:`_find_parents`), and one line per file skipped with the
    reason.

    Skipped: a run folder with no results yet (still running, or stopped before evaluation), a run
    marked failed, a broken results file, a config that does not fit the schema, a run whose train
    length L differs from the most common L, and an older duplicate: a record with the row label, seed and
    evaluation settings of one written later (:func:`written`), which its line names. Raises ReportError for a
    missing folder or when nothing usable is found.
    """
    records, skipped = [], []
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise ReportError(f"{str(folder)!r} is not a folder; give run or sweep folders")
        runs = {p.parent.parent for p in folder.rglob(".hydra/config.yaml")} | {p.parent for p in folder.rglob("results.json")} \
            | {p.parent for p in folder.rglob("eval-*.json")}  # (a pretrained checkpoint's folder holds only these)
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
                    config = upgrade(rec["config"], rec["format"])
                except ValueError as e:
                    skipped.append(f"{path}: {e}")
                    continue
                found.append(rec)
                rec.update(path=str(path), hashes={config_sha256(rec["config"]), config_sha256(config)}, config=config)
                if rec.get("pretrained"):  # its row: the checkpoint's name and what the evaluation applied
                    rec["checkpoint_label"] = rec["label"]
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


def written(rec: dict) -> tuple:
    """When a record was written, as a sort key. Records carry no time of their own, and a copied folder's files get
    new mtimes, so it is read from the path: in a run folder, ``results.json`` (training's) before the
    ``eval-…-<n>.json`` of ``posbench eval`` by n (each takes the first n free: a higher n was written later);
    across run folders, by path (Hydra's dated folders, ``multirun/2026-11-21/10-00-00``, sort as they were made).
    Numbers in names count as numbers (``-10`` after ``-9``)."""
    def natural(text: str) -> tuple:
        return tuple(int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", text)))

    path = Path(rec["path"])
    return natural(str(path.parent)), path.name != "results.json", natural(path.name)


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
        if trained is not None and (rec.get("scheme_overrides") or rec.get("model_overrides")):
            rec["applied"] = applied(rec["config"], trained["config"], trained.get("lineage"))


def _dedupe(records: list[dict], skipped: list[str]) -> tuple[list[dict], list[str]]:
    """Set each record's row (:func:`posbench.report.settings.name_rows`) and ``parent`` (:func:`_find_parents`); keep
    the newest (:func:`written`) of records with the same setting, seed and evaluation settings, and add a line to
    ``skipped`` for each older one, naming the newer; label the rows kept (``short_labels``). Returns the records
    kept, by path, and ``skipped``."""
    name_rows(records)
    _find_parents(records)
    newest = {(r["setting"], json.dumps(r["seed"]), eval_settings(r)): r["path"] for r in sorted(records, key=written)}
    newer = {r["path"]: newest[r["setting"], json.dumps(r["seed"]), eval_settings(r)] for r in records}
    skipped += [f"{path}: older duplicate of {new} (the same setting, seed and evaluation settings); the newer is "
                "reported" for path, new in sorted(newer.items()) if new != path]
    kept = [r for r in sorted(records, key=lambda r: r["path"]) if newer[r["path"]] == r["path"]]
    short_labels(kept)
    return kept, skipped


def _find_parents(records: list[dict]) -> None:
    """Set ``parent`` on each fine-tuned record (``lineage``: posbench/training/lineage.py): the ``setting`` of its
    parent's record, the one whose config has the hash the lineage records (``config_sha256``), wherever the pair of
    runs now lies; without one, the training record (``results.json``) in the folder the lineage records; for a
    pretrained parent (``lineage.pretrained``), the newest ``posbench eval pretrained=`` record of the same weights (their
    sha256) that changed nothing at evaluation; else None."""
    by_hash = {h: r for r in sorted(records, key=lambda r: r["path"], reverse=True) for h in r["hashes"]}  # first by path
    by_folder = {Path(r["path"]).resolve().parent: r for r in records if Path(r["path"]).name == "results.json"}
    by_weights = {r["pretrained"].get("sha256"): r for r in sorted(records, key=written) if r.get("pretrained") and not (
        r.get("scheme_overrides") or r.get("model_overrides") or r["config"]["eval"]["remap"] != "none")}
    for rec in (r for r in records if r.get("lineage")):
        sha, folder = rec["lineage"].get("config_sha256"), rec["lineage"].get("folder")
        checkpoint = (rec["lineage"].get("pretrained") or {}).get("sha256")
        parent = by_hash.get(sha) or by_weights.get(checkpoint) or (
            by_folder.get(Path(folder).resolve()) if folder and not checkpoint else None)
        rec["parent"] = parent["setting"] if parent and parent is not rec else None


def orphans(records: list[dict]) -> list[str]:
    """One line per fine-tuned run folder whose parent is not among ``records`` (``parent`` None: :func:`_find_parents`),
    naming its label, its folder and the parent folder its lineage records."""
    return list(dict.fromkeys(
        f"{r['label']} ({Path(r['path']).parent}): its parent {r['lineage'].get('folder')} is not among the reported "
        "runs (no record of its config, nor a results.json in that folder): the fine-tune plot has no line of it"
        for r in records if r.get("lineage") and "parent" in r and r["parent"] is None))


RECORD_KEYS = ("format", "scheme", "train_length", "protocol", "stride", "split", "seed", "config", "results")
ROW_KEYS = ("length", "ppl", "nll", "nll_by_position")


def _well_formed(rec) -> bool:
    """A results record of a :data:`READABLE` format with every key the report reads."""
    return (isinstance(rec, dict) and all(k in rec for k in RECORD_KEYS) and rec["format"] in READABLE
            and isinstance(rec["config"], dict) and isinstance(rec["results"], list) and len(rec["results"]) > 0
            and all(isinstance(r, dict) and all(k in r for k in ROW_KEYS) for r in rec["results"]))
