"""scripts/gpu_probe.py's CPU mode: every section runs its plumbing at tiny sizes, records no error, and its numbers
agree with what an independent computation says they must be (Flex's outputs within float32 rounding of a float64
reference, every table layout's gradient equal to the per-pair one's, the direct BlockMask equal to the dense one)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posbench.model.build import build_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    torch.manual_seed(0)
    spec = {"vocab_size": 64, "scheme": {"name": "alibi"},
            "model": {"n_layer": 1, "n_head": 2, "d_model": 16, "d_ff": 32}}
    model = build_model(spec)
    torch.save({"spec": spec, "model": model.state_dict(), "config": {"train": {"seq_len": 16}}, "vocab_size": 64},
               tmp / "alibi.pt")
    torch.save(torch.randint(0, 64, (4 * 16 * 16 + 1,)), tmp / "tokens.pt")
    out = tmp / "probe.jsonl"
    run = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_probe.py"), "--device", "cpu", "--out", str(out),
                          "--checkpoints", str(tmp / "alibi.pt"), "--tokens", str(tmp / "tokens.pt"), "--eval-rows", "2",
                          "--threads", "1"], capture_output=True, text=True, timeout=600, cwd=tmp)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return run, rows, [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_every_section_runs_without_an_error_and_prints_what_it_writes(probe):
    run, rows, printed = probe
    assert run.returncode == 0, run.stderr[-2000:]
    assert rows == printed
    assert [r for r in rows if "error" in r or "skipped" in r] == []
    for section in ("S0", "S1", "S2", "S3", "S4", "S5"):
        events = [r["event"] for r in rows if r["section"] == section and "event" in r]
        assert events == ["start", "end"], section
    assert rows[-1]["event"] == "done"


def test_flex_outputs_match_the_float64_reference_and_bf16_is_coarser(probe):
    cases = {r["case"]: r for r in probe[1] if r["section"] == "S1" and "max_err" in r}
    for name in ("causal", "alibi", "t5", "fire", "kerple_log", "sandwich"):
        assert cases[f"{name}.ieee"]["max_err"] < 1e-5, name
        assert cases[f"{name}.bf16"]["max_err"] > 10 * cases[f"{name}.ieee"]["max_err"], name
    assert cases["fire_mlp.ieee"]["max_err"] < 1e-5
    assert cases["sdpa.fp32"]["max_err"] < 1e-5


def test_every_table_layout_gives_the_per_pair_gradient(probe):
    grads = {r["case"]: r["grad_rel_err"] for r in probe[1] if r["section"] == "S2" and "grad_rel_err" in r}
    layouts = {c.split(".")[1] for c in grads}
    assert {"shared", "pair"} <= layouts
    assert all(err < 1e-5 for err in grads.values()), grads


def test_the_direct_block_mask_equals_the_dense_one(probe):
    masks = [r for r in probe[1] if r["section"] == "S3" and r.get("case", "").startswith("block_mask.")]
    assert len(masks) == 2 and all(r["equal"] for r in masks)


def test_the_checkpoint_is_evaluated_at_each_length_and_tf32x3_changes_nothing_on_cpu(probe):
    rows = [r for r in probe[1] if r["section"] == "S4" and "nll_fp32" in r]
    assert [r["case"] for r in rows] == ["alibi.16", "alibi.32", "alibi.64", "alibi.128", "alibi.256"]
    assert all(r["d_tf32x3"] == 0 and 3 < r["nll_fp32"] < 6 for r in rows)  # (random weights: about ln 64 = 4.16)
    decisions = {r["decision"]: r for r in probe[1] if r["section"] == "S4" and "decision" in r}
    assert decisions["tf32x3_evaluation"]["adopt"] is True


def test_the_base_model_trains_in_each_configuration_and_is_profiled(probe):
    rows = {r["case"]: r for r in probe[1] if r["section"] == "S5" and "case" in r}
    for case in ("base.b2.plain_head", "base.b2.chunked_head", "base.b4.plain_head"):
        assert rows[case]["tokens_per_s"] > 0 and rows[case]["mfu"] is None
    assert rows["profile"]["top"] and abs(sum(rows["profile"]["families"].values()) - 1) < 1e-3  # (shares rounded to 1e-4)
