"""Runs started from another run's weights (``init_from``): what they load, what they take from the parent, what
starts fresh, what they refuse, what they log and record, and that they resume like any run.

Parents are ``posbench train debug=fast`` runs (L = 32, 4 steps); fine-tunes run at L = 64 unless a test says
otherwise. Expected weights come from the parent's checkpoint file, read here with ``torch.load``, or from a model
built here; an interpolated table is checked against ``numpy.interp``.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import free_port, refused, rows, run_into, snapshot
from posbench.data import cache
from posbench.data.batches import get_batch
from posbench.model import build
from test_resume import cli, kill_and_resume

FT = ["train.seq_len=64", "eval.lengths=[32,64,128]", "train.schedule=constant", "train.warmup_steps=2"]


def weights(run) -> dict:
    return torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True)


def record(run) -> dict:
    return json.loads((run / "results.json").read_text())


@pytest.fixture(scope="module")
def parents(run_cli, data_cache, tmp_path_factory):
    """{scheme: finished debug=fast run folder} for rope, learned (a 64-row table) and t5."""
    root, out = tmp_path_factory.mktemp("parents"), {}
    for scheme, extra in (("rope", []), ("learned", ["scheme.max_positions=64", "eval.lengths=[32,64]"]), ("t5", [])):
        proc = run_into(run_cli, data_cache, root / scheme, f"scheme={scheme}", *extra)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out[scheme] = root / scheme
    return out


def finetune(run_cli, data_cache, run, parent, *overrides):
    proc = run_into(run_cli, data_cache, run, f"init_from={parent}", *FT, *overrides)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run


# ---- what a run starts from --------------------------------------------------------------------------------


def test_zero_steps_holds_the_parents_weights_tensor_by_tensor(run_cli, data_cache, parents, tmp_path):
    run = finetune(run_cli, data_cache, tmp_path / "ft", parents["rope"], "train.steps=0", "scheme.scaling=yarn",
                   "scheme.factor=2")
    theirs, mine = weights(parents["rope"])["model"], weights(run)["model"]
    assert mine.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(mine[key], theirs[key]), key
    rec = record(run)
    assert rec["train_tokens"] == 0 and rec["label"] == "rope+yarn×2 ft64×0"
    assert rec["config"]["scheme"]["original_length"] == 32  # a scaling scales from the parent's L


def test_llama3_scaling_applies_to_a_parent_as_any_scaling(run_cli, data_cache, parents, tmp_path):
    run = finetune(run_cli, data_cache, tmp_path / "ft", parents["rope"], "train.steps=0", "scheme.scaling=llama3",
                   "scheme.factor=4", "scheme.high_freq_factor=1")
    rec = record(run)
    assert rec["label"] == "rope+llama3[1-1]×4 ft64×0"
    assert rec["config"]["scheme"]["original_length"] == 32 and rec["config"]["scheme"]["low_freq_factor"] == 1.0


def test_first_step_starts_from_the_parents_weights_with_a_fresh_optimizer(run_cli, data_cache, parents, tmp_path):
    """One step: Adam's state after it is that of step 1 from the parent's weights (its first moment is (1 − β1)
    times the gradient at the parent's weights, computed here), and the learning rate is the warmup's first."""
    run = finetune(run_cli, data_cache, tmp_path / "ft", parents["rope"], "train.steps=1", "train.warmup_steps=4",
                   "train.lr=1e-3", "train.threads=1", "train.grad_clip=0")
    state = torch.load(sorted((run / "checkpoints").glob("step-*.pt"))[-1], map_location="cpu", weights_only=True)
    assert state["step"] == 1
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {1.0}
    assert [r["lr"] for r in rows(run)] == [pytest.approx(1e-3 * 1 / 4)]
    parent = weights(parents["rope"])
    model = build.build_model(parent["spec"])
    model.load_state_dict(parent["model"])
    corpus = cache.prepare(**{**parent["config"]["data"], "cache_dir": str(data_cache)})
    x, y = get_batch(corpus.tokens["train"], 0, 0, 4, 64)  # the fine-tune's batch 0 (seed 0, B = 4, L = 64)
    model(x, targets=y).mean().backward()
    first = state["optimizer"]["state"][0]["exp_avg"]  # the first decayed parameter: the first matrix
    grad = next(p for p in model.parameters() if p.requires_grad and p.dim() >= 2).grad
    torch.testing.assert_close(first, 0.1 * grad, rtol=1e-4, atol=1e-8)  # (1 − β1) · g, β1 = 0.9


def test_a_grown_learned_table_keeps_the_trained_rows_bit_for_bit(run_cli, data_cache, parents, tmp_path):
    run = finetune(run_cli, data_cache, tmp_path / "ft", parents["learned"], "scheme=learned", "train.steps=0",
                   "scheme.max_positions=128")
    old, new = weights(parents["learned"])["model"]["scheme.table.weight"], weights(run)["model"]["scheme.table.weight"]
    assert old.shape == (64, 128) and new.shape == (128, 128)
    assert torch.equal(new[:64], old)
    torch.manual_seed(0)  # rows 64… as the scheme initialises them: the new run's model built from scratch
    fresh = build.build_model(weights(run)["spec"]).scheme.table.weight.detach()
    assert torch.equal(new[64:], fresh[64:])


def test_an_unset_table_size_keeps_the_parents(run_cli, data_cache, parents, tmp_path):
    run = finetune(run_cli, data_cache, tmp_path / "ft", parents["learned"], "scheme=learned", "train.steps=0",
                   "eval.lengths=[32,64]")
    assert record(run)["config"]["scheme"]["max_positions"] == 64
    assert torch.equal(weights(run)["model"]["scheme.table.weight"], weights(parents["learned"])["model"]["scheme.table.weight"])


def test_an_interpolated_table_is_position_interpolation_of_the_trained_rows(run_cli, data_cache, parents, tmp_path):
    run = finetune(run_cli, data_cache, tmp_path / "ft", parents["learned"], "scheme=learned", "train.steps=0",
                   "init_rows=interpolate",
                   "eval.lengths=[32,64]")
    old = weights(parents["learned"])["model"]["scheme.table.weight"].double().numpy()  # (64, D); rows 0…31 trained
    new = weights(run)["model"]["scheme.table.weight"].double().numpy()
    x = np.arange(64) * 32 / 64  # PI: new position p reads the parent's table at p · L / L'
    expected = np.stack([np.interp(x, np.arange(32), old[:32, d]) for d in range(old.shape[1])], axis=1)
    np.testing.assert_allclose(new[:64], expected, rtol=1e-6, atol=1e-7)


def test_rope_to_nope_keeps_every_weight_and_drops_positions(run_cli, data_cache, parents, tmp_path):
    run = finetune(run_cli, data_cache, tmp_path / "ft", parents["rope"], "train.steps=0", "scheme=nope")
    theirs, mine = weights(parents["rope"])["model"], weights(run)["model"]
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert record(run)["label"] == "rope→nope ft64×0"


# ---- what a run takes from its parent unless given (issue 28 item 6) ---------------------------------------------


@pytest.fixture(scope="module")
def child(run_cli, data_cache, parents, tmp_path_factory):
    """A run from the learned parent (L = 32, 64 rows) that names neither the scheme nor L, nor debug=fast (whose L
    would be given): its table grown to 128 rows, one step under the default 40 warmup steps."""
    run = tmp_path_factory.mktemp("child") / "ft"
    proc = run_cli("train", f"init_from={parents['learned']}", "scheme.max_positions=128", "train.steps=1",
                   "eval.lengths=[32,64,128]", "eval.max_tokens=256", f"data.cache_dir={data_cache}",
                   f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run, proc.stdout + proc.stderr


def test_a_run_takes_the_parents_scheme_with_its_options(child):
    """``scheme.max_positions=128`` alone: an option of the parent's learned scheme (it was refused as "not an
    option of the rope scheme", the default)."""
    run, _ = child
    assert record(run)["config"]["scheme"] == {"name": "learned", "max_positions": 128}
    assert record(run)["label"] == "learned ft32×1"


def test_a_run_takes_the_parents_length(child):
    run, _ = child
    assert record(run)["config"]["train"]["seq_len"] == 32  # the parent's L, not the default 128


def test_a_warmup_longer_than_the_run_is_a_warning_at_start(child, parents):
    run, out = child
    warning = ("train.warmup_steps=40 >= train.steps=1: every step is a warmup step, and the learning rate ends at "
               "1/40 of train.lr=0.002, never reaching it; give train.warmup_steps below 1")
    assert f"[WARNING] - {warning}" in out and warning in (run / "train.log").read_text()
    assert "every step is a warmup step" not in (parents["learned"] / "train.log").read_text()  # debug=fast: 1 of 4


def test_the_options_that_differ_from_the_parents_are_logged_at_start(child, parents):
    run, out = child
    line = next(ln for ln in (run / "train.log").read_text().splitlines() if "differ from the parent" in ln)
    assert line.endswith(f"[INFO] - init_from={parents['learned']}: the options that differ from the parent's: "
                         "scheme.max_positions: 64 → 128, train.batch_size: 4 → 16, train.steps: 4 → 1, "
                         "train.warmup_steps: 1 → 40, train.log_every: 1 → 50, eval.lengths: [32, 64] → [32, 64, 128]"), line
    assert out.index("differ from the parent") < out.index("starting from the weights")


def test_debug_fast_keeps_a_presets_lengths(run_cli):
    """``experiment=extend debug=fast`` fine-tunes at the preset's 512 (debug's L = 32 used to win)."""
    proc = run_cli("train", "experiment=extend", "debug=fast", "--cfg", "job")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "seq_len: 512" in proc.stdout and "- 4096" in proc.stdout and "steps: 4" in proc.stdout


def test_cfg_job_shows_what_a_run_takes_from_its_parent(run_cli, parents):
    proc = run_cli("train", f"init_from={parents['learned']}", "--cfg", "job")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "scheme:\n  name: learned\n  max_positions: 64\n" in proc.stdout and "  seq_len: 32\n" in proc.stdout


# ---- refusals: exit 2, one line, nothing written ------------------------------------------------------------


@pytest.fixture
def other_tokenizer(parents, tmp_path):
    """A copy of the rope parent trained (so its checkpoint says) with another tokenizer: a file one byte longer."""
    state = torch.load(parents["rope"] / "checkpoint.pt", map_location="cpu", weights_only=True)
    (tmp_path / "other").mkdir()
    tokenizer = tmp_path / "other" / "tokenizer.json"
    tokenizer.write_bytes(open(state["tokenizer"]["path"], "rb").read() + b" ")
    state["tokenizer"] = {**state["tokenizer"], "path": str(tokenizer)}
    torch.save(state, tmp_path / "other" / "checkpoint.pt")
    return tmp_path / "other"


REFUSALS = [
    ("rope", ["scheme=alibi"], r"scheme=alibi but init_from=\S+ was trained with scheme=rope: the weights of one scheme "
                               r"do not load into another; drop scheme=alibi .* or, after rope, give scheme=nope"),
    ("rope", ["model.d_model=64"], r"model.d_model=64 but init_from=\S+ has model.d_model=128"),
    ("rope", ["model.n_layer=2"], r"model.n_layer=2 but init_from=\S+ has model.n_layer=4"),
    ("rope", ["data.vocab_size=2048"], r"data.vocab_size=2048 but init_from=\S+ has data.vocab_size=4096"),
    ("rope", ["init_rows=interpolate"], r"init_rows=interpolate: the RoPE scheme has no position table"),
    ("learned", ["scheme=learned", "scheme.max_positions=48", "train.seq_len=32", "eval.lengths=[32,48]"],
     r"max_positions=48: the parent's table has 64 rows"),
    ("t5", ["scheme=t5", "scheme.num_buckets=16"], r"scheme.num_buckets=16 but init_from=\S+ has scheme.num_buckets=32"),
    ("rope", ["scheme.rotary_fraction=0.5"], r"scheme.rotary_fraction=0.5 but init_from=\S+ has scheme.rotary_fraction=1.0: "
                                             r"a fine-tune of rope may change base, scaling"),
    ("learned", ["scheme=learned", "init_rows=interpolate", "scheme.max_positions=48", "train.seq_len=32",
                 "eval.lengths=[32,48]"], r"max_positions=48: the parent's table has 64 rows"),
    ("missing", [], r"init_from='\S+': no checkpoint.pt there"),
    (None, ["train.steps=0"], r"train.steps=0 needs init_from=<run folder>"),
    (None, ["init_rows=interpolate"], r"init_rows=interpolate applies to a run started from a parent"),
]


@pytest.mark.parametrize("parent, overrides, message", REFUSALS, ids=[" ".join(r[1]) or r[0] for r in REFUSALS])
def test_refusals_exit_2_with_nothing_written(run_cli, posbench_here, data_cache, parents, tmp_path, parent, overrides,
                                              message):
    """Each refusal in this process (``posbench_here``), the first also as a process of its own (exit status 2, one
    line on stderr, no traceback)."""
    cli = run_cli if (parent, overrides) == REFUSALS[0][:2] else posbench_here
    run = tmp_path / "ft"
    run.mkdir()
    before = snapshot(run)
    source = tmp_path / "nowhere" if parent == "missing" else parents.get(parent)
    given = [f"init_from={source}"] if source else []
    line = refused(run_into(cli, data_cache, run, *given, *FT, *overrides), run, before)
    assert re.search(message, line), line
    if parent in parents:  # the parent is untouched too
        assert (parents[parent] / "checkpoint.pt").exists()
    if "vocab_size" in " ".join(overrides):  # refused before the data: no cache of another vocabulary was built
        assert not any("-" in p.name and p.is_dir() and json.loads((p / "meta.json").read_text())["vocab_size"] == 2048
                       for p in data_cache.iterdir() if (p / "meta.json").exists())


def test_a_parents_option_is_not_silently_replaced_by_a_default(run_cli, data_cache, tmp_path):
    """A parent trained with a non-default option: a child that names the scheme (its defaults) and leaves the
    option at the default is refused, naming both; one that names no scheme takes the parent's options."""
    parent = tmp_path / "parent"
    assert run_into(run_cli, data_cache, parent, "scheme=xpos", "scheme.gamma=0.8").returncode == 0
    run = tmp_path / "ft"
    run.mkdir()
    before = snapshot(run)
    line = refused(run_into(run_cli, data_cache, run, f"init_from={parent}", "scheme=xpos", *FT), run, before)
    assert re.search(r"scheme.gamma=0.4 but init_from=\S+ has scheme.gamma=0.8: .*give scheme.gamma=0.8", line), line
    ok = run_into(run_cli, data_cache, tmp_path / "ok", f"init_from={parent}", "scheme=xpos", "scheme.gamma=0.8", *FT,
                  "train.steps=0")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    taken = run_into(run_cli, data_cache, tmp_path / "taken", f"init_from={parent}", *FT, "train.steps=0")
    assert taken.returncode == 0, taken.stdout + taken.stderr
    assert record(tmp_path / "taken")["config"]["scheme"] == record(tmp_path / "ok")["config"]["scheme"]


def test_a_sweep_over_parents_that_differ_is_refused(run_cli, data_cache, parents, tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli("train", "-m", "debug=fast", f"init_from={parents['rope']},{parents['learned']}", "train.steps=0",
                   f"data.cache_dir={data_cache}", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert re.fullmatch(r"posbench: error: init_from=\S+,\S+: a run takes its parent's scheme, scheme options, L and "
                        r"layers, and these parents differ \(.*scheme.name=rope .*; .*scheme.name=learned .*\); .*",
                        proc.stderr.strip())
    assert not sweep.exists()


def test_a_run_cannot_start_from_its_own_folder(run_cli, data_cache, parents, tmp_path):
    import shutil

    run = tmp_path / "own"
    shutil.copytree(parents["rope"], run)
    before = snapshot(run)
    line = refused(run_into(run_cli, data_cache, run, f"init_from={run}", *FT, "resume=never"), run, before)
    assert "is this run's own folder" in line, line


def test_a_different_tokenizer_is_refused(run_cli, data_cache, other_tokenizer, tmp_path):
    run = tmp_path / "ft"
    run.mkdir()
    before = snapshot(run)
    line = refused(run_into(run_cli, data_cache, run, f"init_from={other_tokenizer}", *FT), run, before)
    assert "was trained with the tokenizer" in line and "token ids would not match" in line, line


# ---- lineage: results.json, the report -----------------------------------------------------------------------


def test_lineage_round_trips_through_results_and_the_report(run_cli, data_cache, parents, tmp_path):
    run = finetune(run_cli, data_cache, tmp_path / "sweep" / "ft", parents["rope"], "train.steps=3",
                   "scheme.scaling=linear", "scheme.factor=2")
    parent = weights(parents["rope"])
    lineage, rec = record(run)["lineage"], record(run)
    assert lineage["folder"] == str(parents["rope"].resolve())
    assert lineage["step"] == 4 and lineage["train_tokens"] == 4 * 4 * 32 == record(parents["rope"])["train_tokens"]
    assert lineage["config_sha256"] == hashlib.sha256(json.dumps(parent["config"], sort_keys=True).encode()).hexdigest()
    assert (lineage["train_length"], lineage["origin_length"]) == (32, 32)
    assert rec["train_tokens"] == 3 * 4 * 64 and rec["total_train_tokens"] == 4 * 4 * 32 + 3 * 4 * 64
    assert rec["label"] == "rope+linear×2 ft64×3"
    assert weights(run)["total_train_tokens"] == rec["total_train_tokens"]

    out = tmp_path / "report"  # the parent (L = 32) and its fine-tune (L = 64) in one report, at the parent's L
    proc = run_cli("report", str(parents["rope"]), str(tmp_path / "sweep"), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    md = (out / "report.md").read_text()
    assert "(L = 32)" in md
    ft_row = next(line for line in md.splitlines() if line.startswith("| rope+linear×2 ft64×3"))
    assert "768 / 1,280" in ft_row, ft_row  # own / total train tokens
    assert (out / "ppl_vs_finetune.png").exists()
    import csv

    report_rows = list(csv.DictReader(open(out / "report.csv")))
    assert {r["total_train_tokens"] for r in report_rows if r["setting"].startswith("rope+linear")} == {"1280"}

    again = run_cli("eval", f"run={run}", "eval.lengths=[64]")  # posbench eval keeps the label and the lineage
    assert again.returncode == 0, again.stdout + again.stderr
    evaluated = json.loads(next(run.glob("eval-*.json")).read_text())
    assert evaluated["label"] == "rope+linear×2 ft64×3" and evaluated["lineage"] == lineage


def test_a_sweep_over_the_extend_methods(run_cli, data_cache, parents, tmp_path):
    """``-m +extend=…``: conf/extend/'s methods compose with a parent, each labelled by what it did."""
    sweep = tmp_path / "sweep"
    proc = run_cli("train", "-m", "debug=fast", f"data.cache_dir={data_cache}", f"init_from={parents['rope']}",
                   "+extend=direct,pi", "train.seq_len=64", "train.batch_size=2", "eval.lengths=[32,64,128]",
                   f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    labels = sorted(json.loads(p.read_text())["label"] for p in sweep.glob("*/results.json"))
    assert labels == ["rope ft64×4", "rope+linear×4 ft64×4"]


# ---- a fine-tune resumes like any run ---------------------------------------------------------------------


def test_killed_fine_tune_resumes_bit_identically(data_cache, parents, tmp_path):
    args = [f"init_from={parents['rope']}", *FT, "train.steps=12", "train.checkpoint_every=4", "train.threads=1",
            "train.log_every=1", "scheme.scaling=yarn", "scheme.factor=2", "eval.max_tokens=256"]
    a = cli(tmp_path / "A", data_cache, *args)
    assert a.returncode == 0, a.stdout + a.stderr
    run = tmp_path / "B"
    kill_and_resume(run, data_cache, *args)
    assert [(r["step"], r["loss"], r["lr"]) for r in rows(run)] == [(r["step"], r["loss"], r["lr"]) for r in rows(tmp_path / "A")]
    assert record(run)["param_sha256"] == record(tmp_path / "A")["param_sha256"]
    assert record(run)["lineage"] == record(tmp_path / "A")["lineage"]


def test_torchrun_fine_tune_starts_every_rank_from_the_parent(data_cache, parents, tmp_path):
    from test_ddp import _env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "posbench", "train", "debug=fast", f"data.cache_dir={data_cache}",
           f"init_from={parents['rope']}", *FT, "train.steps=0", "train.threads=1", "eval.max_tokens=256",
           f"hydra.run.dir={tmp_path / 'ddp'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = record(tmp_path / "ddp")
    assert rec["world_size"] == 2 and len(set(rec["param_sha256"])) == 1
    theirs = weights(parents["rope"])["model"]
    assert all(torch.equal(weights(tmp_path / "ddp")["model"][k], v) for k, v in theirs.items())
