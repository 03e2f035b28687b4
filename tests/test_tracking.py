"""wandb tracking, read back from what a real offline run writes: ``<run>/wandb/offline-run-*/run-*.wandb``.

That file is a LevelDB-log-style stream (wandb/sdk/internal/datastore.py): a 7-byte header (":W&B",
2-byte magic, 1-byte version), then 32 KiB blocks of records, each with a 7-byte header (crc32 uint32,
length uint16, type uint8; little endian; 1 FULL, 2 FIRST, 3 MIDDLE, 4 LAST) — a block tail shorter
than a header is padding — whose payloads are serialized ``wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import json
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from helpers import cli_env, ok
from helpers import posbench as run_posbench

BLOCK, HEADER = 32 * 1024, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_records(path: Path, kinds: list | None = None) -> list:
    """Every ``Record`` in a ``.wandb`` file, in order (checksums verified); ``kinds`` collects the
    chunk types read (and "padding" for each block tail skipped)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), data[:HEADER]
    payloads, pending, pos = [], None, HEADER
    while pos < len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block tail padding
            if kinds is not None:
                kinds.append("padding")
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos: pos + HEADER])
        if crc == length == kind == 0:  # zero fill at the end
            break
        chunk = data[pos + HEADER: pos + HEADER + length]
        assert len(chunk) == length, f"truncated record at byte {pos}"
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"bad checksum at byte {pos}"
        pos += HEADER + length
        if kinds is not None:
            kinds.append(kind)
        if kind == FULL:
            assert pending is None
            payloads.append(chunk)
        elif kind == FIRST:
            assert pending is None
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            payloads.append(pending + chunk)
            pending = None
        else:
            raise AssertionError(f"unknown record type {kind} at byte {pos}")
    assert pending is None, "the file ends inside a record"
    records = []
    for payload in payloads:
        rec = pb.Record()
        rec.ParseFromString(payload)
        records.append(rec)
    return records


def history(records) -> list[dict]:
    """History rows as {key: value} (nested keys joined with "/")."""
    return [{(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def run_record(records):
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert len(runs) == 1
    return runs[0]


def run_config(records) -> dict:
    """The run config: the run record's config, then every "config" record's updates."""
    out = {}
    updates = [*run_record(records).config.update,
               *(u for r in records if r.WhichOneof("record_type") == "config" for u in r.config.update)]
    for item in updates:
        out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def wandb_file(folder: Path) -> Path:
    files = sorted(folder.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline run under {folder}/wandb: {files}"
    return files[0]


def posbench(*args, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m posbench *args`` with wandb offline (it writes its .wandb file), checked to exit 0."""
    return ok(run_posbench(*args, cwd=cwd, env=cli_env(WANDB_MODE="offline")))


@pytest.fixture(scope="module")
def cache(data_cache) -> Path:
    return data_cache


STEPS = 120  # enough history (~0.6 KiB a step) for a .wandb file well past one 32 KiB block (48 left it near the
# boundary: wandb zero-fills its file ahead, so a run that wrote under 32 KiB of records still passed the size check)


def test_offline_run_logs_train_and_eval_metrics_and_config(tmp_path, cache):
    run = tmp_path / "run"
    posbench("train", "debug=fast", "scheme=alibi", f"train.steps={STEPS}", "train.batch_size=1",
             f"hydra.run.dir={run}", f"data.cache_dir={cache}", cwd=tmp_path)
    path = wandb_file(run)
    assert path.stat().st_size > BLOCK, "the reader should see records across a block boundary"
    kinds = []
    records = read_wandb_records(path, kinds)
    assert (FIRST in kinds and LAST in kinds) or "padding" in kinds, "the reader never met a block boundary"
    rows = history(records)
    results = json.loads((run / "results.json").read_text())

    evals = [r for r in rows if "eval/ppl" in r]
    assert sorted(r["eval/length"] for r in evals) == [32, 64]
    expected = {r["length"]: r for r in results["results"]}
    for r in evals:
        assert r["eval/ppl"] == pytest.approx(expected[r["eval/length"]]["ppl"], rel=1e-9)
        assert r["eval/nll"] == pytest.approx(expected[r["eval/length"]]["nll"], rel=1e-9)

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    assert [r["trainer/step"] for r in train] == list(range(1, STEPS + 1)) == [m["step"] for m in metrics]
    for r, m in zip(train, metrics):
        assert r["train/loss"] == pytest.approx(m["loss"], rel=1e-9)
        assert {"train/lr", "train/grad_norm", "train/tokens_per_s"} <= set(r)

    steps = {m.metric.glob_name or m.metric.name: m.metric.step_metric for m in records
             if m.WhichOneof("record_type") == "metric"}
    assert steps.get("train/*") == "trainer/step" and steps.get("eval/*") == "eval/length", steps

    config = run_config(records)
    assert config["scheme"]["name"] == "alibi"
    assert config["train"]["seq_len"] == 32 and config["eval"]["lengths"] == [32, 64]
    meta = run_record(records)
    assert meta.display_name == "alibi" and meta.job_type == "train" and meta.project == "posbench"


def test_sweep_runs_are_named_by_their_label_and_overrides_and_grouped(tmp_path, cache):
    sweep = tmp_path / "sweep"
    posbench("train", "-m", "debug=fast", "scheme=alibi,rope", "train.lr=0.002,0.003", f"hydra.sweep.dir={sweep}",
             f"data.cache_dir={cache}", cwd=tmp_path)
    jobs = sorted(p.parent for p in sweep.glob("*/results.json"))
    assert len(jobs) == 4
    runs = [run_record(read_wandb_records(wandb_file(job))) for job in jobs]
    assert sorted(r.display_name for r in runs) == ["alibi,train.lr=0.002", "alibi,train.lr=0.003",
                                                     "rope,train.lr=0.002", "rope,train.lr=0.003"]
    groups = {r.run_group for r in runs}
    assert len(groups) == 1 and groups.pop() == f"{tmp_path.name}/sweep"
    assert {r.job_type for r in runs} == {"train"}

    # the sweep's report, logged by the multirun-end callback to a run of the same group
    summary = run_record(read_wandb_records(wandb_file(sweep)))
    assert summary.job_type == "report" and summary.run_group == runs[0].run_group
    assert (sweep / "report.md").is_file()


def test_a_rerun_in_the_same_folder_continues_the_same_wandb_run(tmp_path, cache):
    """The run id is kept in the run folder: running the command again there (a resume, or here a finished
    run that re-evaluates) logs to the same wandb run, not to a second one."""
    run = tmp_path / "run"
    for _ in range(2):
        posbench("train", "debug=fast", "train.steps=4", f"hydra.run.dir={run}", f"data.cache_dir={cache}", cwd=tmp_path)
    files = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2
    ids = {run_record(read_wandb_records(f)).run_id for f in files}
    assert ids == {(run / "wandb" / "run-id").read_text().strip()}


def test_a_resumed_run_sends_each_training_step_to_wandb_once(tmp_path, cache):
    """A run killed after step 8 with its last checkpoint at step 4 (simulated: the step-8 state deleted) resumes
    from 4; steps 5…8, which wandb already has from before the kill, are not logged a second time."""
    from posbench.training import checkpoint

    run = tmp_path / "run"
    args = ("train", "debug=fast", "train.steps=8", "train.checkpoint_every=4", f"hydra.run.dir={run}",
            f"data.cache_dir={cache}")
    posbench(*args, cwd=tmp_path)
    for path in (run / checkpoint.STATES).glob("step-00000008.pt*"):
        path.unlink()
    posbench(*args, cwd=tmp_path)
    files = sorted(run.glob("wandb/offline-run-*/run-*.wandb"), key=lambda f: f.stat().st_mtime)
    assert len(files) == 2
    steps = [[row["trainer/step"] for row in history(read_wandb_records(f)) if "trainer/step" in row] for f in files]
    assert steps == [list(range(1, 9)), []]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, 9))
