"""Nothing silently dropped by the report: of the records of one setting, seed and evaluation settings the newest is
reported, and each older one is named as skipped with the record that replaced it; a fine-tune's parent is found by
the config hash its lineage records wherever the pair of runs now lies (the folder it records when no record has the
hash), and a parent not among the reported records is named in report.md.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from posbench.report import compare, render
from posbench.report.records import collect, orphans
from test_report import config, fake_ppl, md_tables, rows_for, sections, write_eval, write_run

MIX = Path(__file__).parent / "fixtures" / "report_mix"

# ---- the newer record of a setting ---------------------------------------------------------------


def test_a_reevaluation_written_later_replaces_the_earlier_record(tmp_path):
    root = tmp_path / "runs"
    cfg = config("rope", 0)
    run = write_run(root / "rope0", cfg)  # results.json, at fake_ppl's numbers
    first = write_eval(run, cfg, rows_for(cfg, lambda n: 50.0))
    second = write_eval(run, cfg, rows_for(cfg, lambda n: 99.0))  # the same settings evaluated again, afterwards
    assert (first.name, second.name) == ("eval-rope-nonoverlapping-validation-1.json",
                                         "eval-rope-nonoverlapping-validation-2.json")
    records, skipped = collect([root])
    assert [r["path"] for r in records] == [str(second)]
    older = {str(run / "results.json"), str(first)}
    assert {line.split(": ", 1)[0] for line in skipped} == older, skipped
    for line in skipped:
        assert str(second) in line.split(": ", 1)[1] and "newer" in line, line
    table_text, _, _ = render.write_report([root], tmp_path / "report")
    assert [cell.split(" ")[0] for cell in md_tables(table_text)[0][2]["rope"][:3]] == ["99.00"] * 3, table_text
    listed = sections((tmp_path / "report" / "report.md").read_text())["Skipped"]
    assert all(f"- {line}" in listed for line in skipped), listed


def test_the_tenth_evaluation_is_newer_than_the_second(tmp_path):
    """The number a re-evaluation's file ends in counts as a number: ``-10`` was written after ``-9`` and ``-2``."""
    cfg = config("alibi", 0)
    run = write_run(tmp_path / "alibi0", cfg, results=False)
    paths = [write_eval(run, cfg, rows_for(cfg, lambda n, k=k: 10.0 + k)) for k in range(1, 11)]
    assert paths[-1].name.endswith("-10.json")
    records, skipped = collect([tmp_path])
    assert [r["path"] for r in records] == [str(paths[-1])]
    assert records[0]["results"][0]["ppl"] == 20.0
    assert sorted(line.split(": ", 1)[0] for line in skipped) == sorted(map(str, paths[:-1]))


# ---- a fine-tune's parent ------------------------------------------------------------------------


def sha256_of(cfg: dict) -> str:
    """The config hash a fine-tune's lineage records of its parent (posbench/training/lineage.py: sorted JSON)."""
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()


def write_finetune(folder: Path, parent_cfg: dict, recorded: Path, digest: str | None) -> Path:
    """A run fine-tuned (64 tokens × 5 steps) from the parent of ``parent_cfg``, whose lineage records its parent at
    folder ``recorded`` with config hash ``digest``; evaluated at the parent's lengths (the parent's table)."""
    cfg = config(parent_cfg["scheme"]["name"], parent_cfg["seed"], seq_len=64)
    cfg["train"]["steps"], cfg["eval"]["lengths"] = 5, parent_cfg["eval"]["lengths"]
    lineage = {"folder": str(recorded), "checkpoint": str(recorded / "checkpoint.pt"), "step": 10,
               "train_tokens": 1280, "total_train_tokens": 1280, "label": parent_cfg["scheme"]["name"],
               "scheme": parent_cfg["scheme"]["name"], "train_length": 32, "origin_length": 32, "init_rows": "scheme",
               **({"config_sha256": digest} if digest else {})}
    return write_run(folder, cfg, rows=rows_for(cfg, lambda n: 40.0), lineage=lineage, total_train_tokens=2560)


def test_a_moved_parent_is_found_by_its_config_hash(tmp_path):
    parent_cfg = config("rope", 0)
    write_run(tmp_path / "moved" / "rope0", parent_cfg)
    write_finetune(tmp_path / "moved" / "ft", parent_cfg, tmp_path / "before" / "rope0", sha256_of(parent_cfg))
    rows = compare.fold(collect([tmp_path / "moved"])[0])
    assert compare.finetune_parents(rows) == {"rope": pytest.approx(fake_ppl("rope", 0, 128))}
    render.write_report([tmp_path / "moved"], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert "(ppl_vs_finetune.png)" in md and str(tmp_path / "before") not in md, md


def test_the_config_hash_wins_over_the_folder_another_run_now_holds(tmp_path):
    """The folder a lineage records now holds another run (alibi): the parent is the run with the recorded hash."""
    parent_cfg = config("rope", 0)
    write_run(tmp_path / "runs" / "a", parent_cfg)
    write_run(tmp_path / "runs" / "b", config("alibi", 0))
    write_finetune(tmp_path / "runs" / "ft", parent_cfg, tmp_path / "runs" / "b", sha256_of(parent_cfg))
    rows = compare.fold(collect([tmp_path / "runs"])[0])
    assert compare.finetune_parents(rows) == {"rope": pytest.approx(fake_ppl("rope", 0, 128))}


def test_without_a_matching_hash_the_parent_is_found_by_its_folder(tmp_path):
    parent_cfg = config("rope", 0)
    parent = write_run(tmp_path / "runs" / "rope0", parent_cfg)
    write_finetune(tmp_path / "runs" / "ft", parent_cfg, parent, None)
    write_finetune(tmp_path / "runs" / "ft2", parent_cfg, parent, sha256_of(config("rope", 9)))
    rows = compare.fold(collect([tmp_path / "runs"])[0])
    assert compare.finetune_parents(rows) == {"rope": pytest.approx(fake_ppl("rope", 0, 128))}


def test_a_parent_not_among_the_reported_records_is_named_in_the_report(tmp_path):
    gone = tmp_path / "gone" / "rope0"  # neither its folder nor a record of its config is reported
    write_finetune(tmp_path / "runs" / "ft", config("rope", 0), gone, sha256_of(config("rope", 0)))
    write_run(tmp_path / "runs" / "alibi0", config("alibi", 0))
    rows = compare.fold(collect([tmp_path / "runs"])[0])
    assert compare.finetune_parents(rows) == {}
    render.write_report([tmp_path / "runs"], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    named = [line for line in md.splitlines() if str(gone) in line]
    assert len(named) == 1 and "rope ft64×5" in named[0] and str(tmp_path / "runs" / "ft") in named[0], md


def test_the_fixtures_fine_tunes_find_their_parent_copied_from_where_it_was_made():
    """tests/fixtures/report_mix was made with the real CLI in /tmp/mix and copied here: its fine-tunes' lineage
    names /tmp/mix/rope, and the hash it records is that of the copied rope run's config."""
    parent = json.loads((MIX / "rope" / "results.json").read_text())
    records, _ = collect([MIX])
    tuned = [r for r in records if r.get("lineage")]
    assert len(tuned) == 5 and {r["lineage"]["folder"] for r in tuned} == {"/tmp/mix/rope"}
    assert {r["lineage"]["config_sha256"] for r in tuned} == {sha256_of(parent["config"])}
    found = next(r for r in records if Path(r["path"]) == MIX / "rope" / "results.json")
    assert {r["parent"] for r in tuned} == {found["setting"]} and orphans(records) == []
