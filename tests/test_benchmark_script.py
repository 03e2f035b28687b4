"""scripts/benchmark.py end to end at tiny sizes: it runs, prints its table and writes its JSON, whose figures
are positive numbers; and, in-process, its parts that a GPU run depends on: every ``--compile`` case compiled past
Dynamo's default limit of 8 variants, evaluation in float32 while training autocasts, the CUDA ceiling's size and
the datasheet peaks. Nothing here is timed or held to a target: the speed targets live in the benchmark."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"
TINY = ["--d-model", "16", "--layers", "1", "--heads", "2", "--vocab", "64", "--seq-len", "4", "--batch", "2",
        "--threads", "1", "--steps", "1", "--warmup", "1", "--repeats", "1"]


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_benchmark_writes_json_with_positive_ratios(tmp_path):
    out = tmp_path / "bench.json"
    # nope (the baseline) is added; 64 = 16L is where a bias scheme's evaluation targets apply
    args = [*TINY, "--schemes", "alibi", "rope", "--lengths", "4", "64", "--out", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert "targets met" in proc.stdout and "step×rope" in proc.stdout

    r = json.loads(out.read_text())
    assert proc.returncode == (0 if r["all_targets_met"] else 1)  # a missed target fails the run
    assert set(r) == {"machine", "settings", "matmul_ceiling_gflops", "matmul_seconds_all", "ceiling_matmul", "flops", "train",
                      "alibi_step_x_rope", "eval", "targets", "all_targets_met", "source_changed", "peak",
                      "dynamo_in_timed_steps", "remaps", "gemm_ceiling_gflops", "gemm_shapes"}
    assert r["remaps"] == {}  # without --remaps
    # the CPU ceiling as before (1024³ fp32, one sample per round of steps), no datasheet peak, nothing compiled
    assert r["ceiling_matmul"] == "1024x1024 @ 1024x1024 fp32" and len(r["matmul_seconds_all"]) == 1
    assert r["peak"] is None and r["dynamo_in_timed_steps"] is None
    assert all(t["mfu"] is None and t["dynamo"] is None for t in r["train"].values())
    assert r["machine"]["threads"] == 1 and r["machine"]["torch"] == torch.__version__
    assert {"cpu", "device", "dtype", "source"} <= set(r["machine"]) and positive(r["machine"]["cpu_share_in_training"])
    assert r["flops"]["per_token"] > 6 * r["flops"]["n_params"] > 0
    schemes = ["nope", "alibi", "rope"]
    assert list(r["train"]) == list(r["eval"]) == schemes
    figures = [r["matmul_ceiling_gflops"], r["alibi_step_x_rope"], r["gemm_ceiling_gflops"]]
    # the GEMM-shape ceiling: the tiny model's linear layers at B·L = 2·4 rows, one sample per round of steps, and a
    # step's forward GEMMs together at the FLOP-weighted harmonic mean of their rates
    shapes = r["gemm_shapes"]
    assert {g: (v["m"], v["k"], v["n"], v["count"]) for g, v in shapes.items()} == {
        "attn.qkv": (8, 16, 48, 1), "attn.proj": (8, 16, 16, 1), "mlp.0": (8, 16, 64, 1), "mlp.2": (8, 64, 16, 1),
        "head": (8, 16, 64, 1)}
    assert all(len(v["seconds_all"]) == 1 and positive(v["gflops"]) for v in shapes.values())
    flops = {g: 2 * v["m"] * v["k"] * v["n"] * v["count"] for g, v in shapes.items()}
    assert r["gemm_ceiling_gflops"] == pytest.approx(sum(flops.values()) / sum(f / shapes[g]["gflops"] for g, f in flops.items()))
    assert min(v["gflops"] for v in shapes.values()) <= r["gemm_ceiling_gflops"] <= max(v["gflops"] for v in shapes.values())
    assert "GEMM-shape ceiling" in proc.stdout and "over the GEMM-shape ceiling" in proc.stdout
    for s in schemes:
        t = r["train"][s]
        figures += [t["step_seconds"], t["tokens_per_s"], t["gflops"], t["ceiling_fraction"], t["step_x_nope"]]
        assert t["gemm_ceiling_fraction"] == pytest.approx(t["gflops"] / r["gemm_ceiling_gflops"])
        assert t["gemm_ceiling_fractions"] == pytest.approx({g: t["gflops"] / v["gflops"] for g, v in shapes.items()})
        assert set(r["eval"][s]) == {"4", "64"}
        for e in r["eval"][s].values():
            figures += [e["seconds"], e["nope_seconds"], e["time_x_nope"], e["mem_x_nope"]]
            assert isinstance(e["peak_growth_bytes"], int) and e["peak_growth_bytes"] >= 0
    assert all(positive(x) for x in figures), figures
    assert r["train"]["nope"]["step_x_nope"] == 1.0 and r["eval"]["nope"]["64"]["time_x_nope"] == 1.0

    # the ceiling target for each scheme, ALiBi's step against RoPE's, ALiBi's time and memory at 16L (no 64L here)
    where = sorted((t["scheme"], t.get("length", 0)) for t in r["targets"])
    assert where == [("alibi", 0), ("alibi", 0), ("alibi", 64), ("alibi", 64), ("nope", 0), ("rope", 0)]
    step = next(t for t in r["targets"] if t["target"].startswith("train step"))
    assert step["limit"] == 1.10 and step["value"] == r["train"]["alibi"]["step_seconds"] / r["train"]["rope"]["step_seconds"]
    assert all(positive(t["value"]) and positive(t["limit"]) and isinstance(t["met"], bool) for t in r["targets"])
    assert r["all_targets_met"] == all(t["met"] for t in r["targets"])
    assert isinstance(r["source_changed"], bool)


def test_scaled_and_contextual_cases(tmp_path, capsys):
    """A ``rope+ssmax`` case (model.attn_scale=ssmax) and CoPE run, CoPE's evaluation targets 3× nope's, and a
    misspelt scaling is refused by the argument parser (its parse run in this process)."""
    out = tmp_path / "bench.json"
    args = [*TINY, "--schemes", "rope+ssmax", "cope", "--lengths", "4", "64", "--out", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    r = json.loads(out.read_text())
    assert proc.returncode == (0 if r["all_targets_met"] else 1), proc.stderr[-3000:]
    assert list(r["train"]) == ["nope", "rope+ssmax", "cope"]
    assert "cope: contextual kernel" in proc.stdout
    cope = [t for t in r["targets"] if t["scheme"] == "cope" and t.get("length")]
    assert [(t["length"], t["limit"]) for t in cope] == [(64, 3.0), (64, 3.0)]
    capsys.readouterr()
    with pytest.raises(SystemExit) as bad:
        load_benchmark().parse([*TINY, "--schemes", "rope+logn"])
    assert bad.value.code == 2 and "'rope+logn'" in capsys.readouterr().err


def test_windowed_and_hybrid_cases(tmp_path, capsys):
    """A model of sliding-window layers (``rope/L:w2``) and a hybrid (``rope/LG:c2:G=nope``) run; the windowed model
    gets its targets (memory growth against nope's at every length, its time per token at 16L against its own at L),
    the hybrid the train step's against RoPE's; a case with a part the parser does not know is refused."""
    out = tmp_path / "bench.json"
    args = [*TINY, "--layers", "2", "--schemes", "rope", "rope/L:w2", "rope/LG:c2:G=nope", "--lengths", "4", "64",
            "--out", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    r = json.loads(out.read_text())
    assert proc.returncode == (0 if r["all_targets_met"] else 1), proc.stderr[-3000:]
    assert list(r["train"]) == ["nope", "rope", "rope/L:w2", "rope/LG:c2:G=nope"]
    windowed = sorted((t["target"].split(" at ")[0], t.get("length")) for t in r["targets"] if t["scheme"] == "rope/L:w2"
                      and t.get("length"))
    assert windowed == [("windowed eval memory growth", 4), ("windowed eval memory growth", 64),
                        ("windowed eval time per token", 64)]
    per_token = r["eval"]["rope/L:w2"]["64"]
    assert per_token["token_x_at_L"] == pytest.approx(per_token["seconds"] / 64 / (r["eval"]["rope/L:w2"]["4"]["seconds"] / 4))
    assert any(t["scheme"] == "rope/LG:c2:G=nope" and t["target"].startswith("train step") for t in r["targets"])
    assert "rope/L:w2: time per token at 16L / at L" in proc.stdout
    capsys.readouterr()
    with pytest.raises(SystemExit) as bad:
        load_benchmark().parse([*TINY, "--schemes", "rope/LG:x2"])
    assert bad.value.code == 2 and "'x2'" in capsys.readouterr().err


def test_remap_cases(tmp_path, capsys):
    """``--remaps rope@rerope alibi@lm_infinite rope@dca``: cases are evaluated only (their training is their scheme's),
    beside nope's, with their targets at 16L: a rotary remap 2.5× nope's time, a bias one 1.5×, both 2× its memory
    growth; DCA's three rotary regions are reported without a target; a method the parser does not know is refused."""
    out = tmp_path / "bench.json"
    args = [*TINY, "--schemes", "rope", "--remaps", "rope@rerope", "alibi@lm_infinite", "rope@dca",
            "--lengths", "4", "64", "--out", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    r = json.loads(out.read_text())
    assert proc.returncode == (0 if r["all_targets_met"] else 1), proc.stderr[-3000:]
    assert list(r["train"]) == ["nope", "rope"] and list(r["remaps"]) == ["rope@rerope", "alibi@lm_infinite", "rope@dca"]
    assert all(positive(e["time_x_nope"]) and positive(e["mem_x_nope"]) for v in r["remaps"].values() for e in v.values())
    limits = sorted((t["scheme"], t["target"].split(" <= ")[0], t["limit"]) for t in r["targets"] if "@" in t["scheme"])
    assert limits == [("alibi@lm_infinite", "remap eval memory growth at 16L", 2.0),
                      ("alibi@lm_infinite", "remap eval time at 16L", 1.5),
                      ("rope@rerope", "remap eval memory growth at 16L", 2.0), ("rope@rerope", "remap eval time at 16L", 2.5)]
    assert "rope@dca" in proc.stdout
    capsys.readouterr()
    with pytest.raises(SystemExit) as bad:
        load_benchmark().parse([*TINY, "--remaps", "rope@rerop"])
    assert bad.value.code == 2 and "'rope@rerop'" in capsys.readouterr().err


def load_benchmark():
    spec = importlib.util.spec_from_file_location("benchmark_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def dynamo_config():
    """Dynamo's limits as they were, and its caches cleared, after the test (the benchmark sets them process-wide)."""
    cfg = torch._dynamo.config
    keys = ("recompile_limit", "accumulated_recompile_limit", "fail_on_recompile_limit_hit")
    saved = {k: getattr(cfg, k) for k in keys}
    torch._dynamo.reset()
    yield cfg
    torch._dynamo.reset()
    for k, v in saved.items():
        setattr(cfg, k, v)


def test_every_compiled_case_is_compiled_past_dynamos_default_limit(dynamo_config):
    """Nine cases share ``GPT.forward``'s code object, one more than Dynamo's default of 8 compiled variants, after
    which it would run the ninth eager with only a log warning: each case must add its own Dynamo graph, every
    frame converted, and the timed steps none (Dynamo's eager backend: the capture without code generation)."""
    b = load_benchmark()
    cases = ["nope", "sinusoidal", "learned", "alibi", "rope", "xpos", "p_rope", "rope+log_n", "rope+ssmax"]
    assert dynamo_config.recompile_limit < len(cases)  # (else this test shows nothing)
    args = b.parse([*TINY, "--compile", "--compile-backend", "eager", "--schemes", *cases[1:], "--lengths", "4"])
    b.bound_recompiles(len(args.schemes))
    assert dynamo_config.fail_on_recompile_limit_hit and dynamo_config.recompile_limit >= len(cases)
    tr, matmul, share, timed, gemm = b.train(args)
    assert gemm == {}  # (no GEMM shapes asked for)
    assert list(tr) == cases
    for case, r in tr.items():
        d = r["dynamo"]
        assert d["graphs"] >= 1 and d["frames"] == d["frames_ok"] >= 1, (case, d)
    assert timed["graphs"] == timed["frames"] == 0, timed


def test_recompile_limit_reached_is_an_error(dynamo_config):
    """Past the limit the benchmark sets, Dynamo raises instead of running a case eager."""
    b = load_benchmark()
    b.bound_recompiles(1)
    dynamo_config.recompile_limit = 1

    def f(x, k):
        return x * k

    compiled = torch.compile(f, backend="eager")
    compiled(torch.ones(2), 2)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        compiled(torch.ones(2), 3)  # another constant: a second variant


def test_gemm_shapes_are_the_models_linear_layers():
    """The GEMM-shape ceiling times the model's own layers at B·L rows: qkv d→3d, the output projection d→d, the MLP
    d→4d→d, once per layer, and the head d→V once (read from the model, so another width or vocabulary follows)."""
    b = load_benchmark()
    args = b.parse([*TINY, "--layers", "3", "--vocab", "96", "--batch", "3", "--seq-len", "5"])
    shapes = b.gemm_shapes(args, b.make_model(args, "rope"))
    assert {g: (v["m"], v["k"], v["n"], v["count"]) for g, v in shapes.items()} == {
        "attn.qkv": (15, 16, 48, 3), "attn.proj": (15, 16, 16, 3), "mlp.0": (15, 16, 64, 3), "mlp.2": (15, 64, 16, 3),
        "head": (15, 16, 96, 1)}
    total, rate = b.gemm_ceiling(shapes, {g: [1e-6, 2e-6, 3e-6] for g in shapes})  # the median: 2 µs per GEMM
    assert rate["head"] == pytest.approx(2 * 15 * 16 * 96 / 2e-6 / 1e9)
    assert total == pytest.approx(sum(2 * v["m"] * v["k"] * v["n"] * v["count"] for v in shapes.values())
                                  / (13 * 2e-6) / 1e9)  # 13 GEMMs of 2 µs


@pytest.mark.parametrize("case", ["alibi", "alibi/L:w8"])
def test_block_masks_are_built_before_the_peak_memory_is_reset(monkeypatch, case):
    """Every Flex kernel (as on CUDA; Flex's call itself stubbed): the BlockMask of the evaluated length, causal or
    the window's, is in posbench.attention.flex's cache when the high-water mark is read after its reset, and the measured
    forward builds none (before, the first Flex case at a length counted it and later cases on CUDA reused it)."""
    from posbench.attention import choice, dispatch, flex

    b = load_benchmark()
    monkeypatch.setattr(flex, "_block_masks", {})
    monkeypatch.setattr(dispatch, "choose_kernel", lambda *a, **k: "flex")  # (the model's layers)
    monkeypatch.setattr(choice, "choose_kernel", lambda *a, **k: "flex")  # (the benchmark's own cases)
    monkeypatch.setattr(flex, "run", lambda q, k, v, *a, **kw: v)
    seen = []
    monkeypatch.setattr(b, "hwm", lambda: seen.append(set(flex._block_masks)) or 0)
    args = b.parse([*TINY, "--layers", "2", "--schemes", case, "--lengths", "64"])
    b.eval_case(args, case, 64)
    window = b.make_model(args, case).windows[0]
    assert len(seen) == 2 and seen[0] == seen[1], seen  # read after the reset, and after the measured forward
    assert (64, "cpu", window) in seen[0] if window else (64, "cpu") in seen[0]


def test_evaluation_in_float32_training_under_autocast(monkeypatch):
    """With ``--dtype bf16`` the training steps run under bf16 autocast and the evaluation forwards without it, as
    posbench trains (on CUDA) and evaluates."""
    b = load_benchmark()
    seen = {"train": set(), "eval": set()}
    build = b.make_model

    def recording(args, case):
        model = build(args, case)
        forward = model.forward

        def wrapped(*a, **k):
            seen["train" if model.training else "eval"].add(torch.is_autocast_enabled("cpu"))
            return forward(*a, **k)

        model.forward = wrapped
        return model

    monkeypatch.setattr(b, "make_model", recording)
    args = b.parse([*TINY, "--dtype", "bf16", "--schemes", "rope", "--lengths", "8"])
    b.train(args)
    r = b.eval_case(args, "rope", 8)
    assert seen == {"train": {True}, "eval": {False}}
    assert r["seconds"] > 0 and r["dynamo_graphs"] == 0


def test_cuda_ceiling_size_and_datasheet_peaks(monkeypatch):
    """On CUDA the ceiling matmul is 8192³ (1024³ on CPU), and the peak is the datasheet's dense figure of the
    device named, in the run's dtype; none for a device not in the table, or for fp32 with TF32 allowed."""
    b = load_benchmark()
    cpu, cuda = b.parse(TINY), b.parse([*TINY, "--device", "cuda", "--dtype", "bf16"])
    assert (b.ceiling_size(cpu), b.ceiling_size(cuda)) == (1024, 8192)
    assert b.peak(cpu) is None
    expected = {"NVIDIA H100 80GB HBM3": ("H100 SXM", 989, 67), "NVIDIA H100 PCIe": ("H100 PCIe", 756, 51),
                "NVIDIA H100 NVL": ("H100 NVL", 835, 60), "NVIDIA H200": ("H200 SXM", 989, 67),
                "NVIDIA H200 NVL": ("H200 NVL", 835, 60), "NVIDIA GH200 480GB": ("GH200", 989, 67),
                "NVIDIA A100-SXM4-80GB": ("A100", 312, 19.5), "NVIDIA A100 80GB PCIe": ("A100", 312, 19.5),
                "NVIDIA L40S": ("L40S", 362, 91.6), "NVIDIA L40": ("L40", 181, 90.5), "NVIDIA L4": ("L4", 121, 30.3),
                "NVIDIA A10": ("A10", 125, 31.2), "NVIDIA A10G": None, "NVIDIA GeForce RTX 4090": None}
    fp32 = b.parse([*TINY, "--device", "cuda"])
    for name, want in expected.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, name=name: name)
        bf16_peak, fp32_peak = b.peak(cuda), b.peak(fp32)
        got = None if bf16_peak is None else (bf16_peak["device"], bf16_peak["tflops"], fp32_peak["tflops"])
        assert got == want, name
        assert bf16_peak is None or "NVIDIA" in bf16_peak["source"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L4")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")  # TF32 allowed
    assert b.peak(fp32) is None and b.peak(cuda)["tflops"] == 121


def test_profile_step_puts_every_part_of_a_step_and_an_evaluation_in_a_row(tmp_path):
    """scripts/profile_step.py at a tiny size: one row per part, shares of the train step and of the evaluation that
    add up to the wall time (V = 96 unlike any layer width: the matmuls are told apart by their shapes)."""
    script = SCRIPT.parent / "profile_step.py"
    args = ["--d-model", "16", "--layers", "1", "--heads", "2", "--vocab", "96", "--seq-len", "8", "--batch", "2",
            "--eval-length", "32", "--steps", "1", "--threads", "1", "--scheme", "t5"]
    proc = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        parts = line.rsplit(None, 2)
        if len(parts) == 3 and parts[1].endswith("%") and parts[2].endswith("%"):
            rows[parts[0]] = (float(parts[1][:-1]), float(parts[2][:-1]))
    assert {"attention", "MLP", "head and loss", "qkv", "proj", "optimizer", "data", "Python"} <= set(rows), rows
    for column in (0, 1):
        assert 99.0 <= sum(r[column] for r in rows.values()) <= 101.0, rows
    assert rows["attention"][1] > 0 and rows["optimizer"][1] == 0 and rows["optimizer"][0] > 0
