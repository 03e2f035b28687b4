"""scripts/gpu_check.sh without a GPU: it parses, and what it passes on is accepted. Every ``posbench train``
override it uses composes and passes posbench's config checks (``train.device`` set to cpu: a CUDA run is refused on a
machine without one), for every registered scheme, and scripts/benchmark.py's argument parser takes its flags. The
checks themselves need a GPU (docs/gpu.md); ``GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh`` runs their plumbing on
CPU in a few minutes."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from posbench.cli import register
from posbench.config.schema import finalize
from posbench.schemes import SCHEMES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
BENCH = ["nope", "rope", "alibi", "t5", "kerple_log", "fire", "sandwich", "rope/L:w128", "rope/LLLG:c128:G=nope",
         "rope/LG:w128:sink"]  # the script's --schemes

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def settings(device: str) -> dict[str, list[str]]:
    """The script's override and flag lists for ``device`` (GPU_CHECK_PRINT_CONFIG=1: printed, nothing run)."""
    env = {**os.environ, "GPU_CHECK_DEVICE": device, "GPU_CHECK_PRINT_CONFIG": "1"}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out, name = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("== "):
            name = line[3:]
            out[name] = []
        else:
            out[name].append(line)
    return out


def test_script_parses():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_posbench_overrides_pass_the_config_checks(device):
    s = settings(device)
    assert f"train.device={device}" in s["COMMON"]
    common = [o for o in s["COMMON"] if not o.startswith("train.device=")] + ["train.device=cpu"]
    runs = [[f"scheme={name}", *s["ZOO"], *common, f"train.steps={s['STEPS'][0]}"] for name in SCHEMES]
    runs.append([*s["RESUME"], *common, f"train.steps={s['RESUME_STEPS'][0]}"])
    register()
    with initialize_config_module("posbench.conf", version_base="1.3"):
        for overrides in runs:
            cfg = finalize(compose("train", overrides=overrides))  # raises ConfigError on a bad value
            assert cfg.train.steps == int(overrides[-1].split("=")[1])
            assert cfg.train.sync_every == 5 and cfg.wandb.enabled is False
    if device == "cuda":
        assert cfg.model.d_model == 512 and cfg.train.seq_len == 256  # model=small (the last: the resume run)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_benchmark_takes_the_flags(device):
    s = settings(device)
    spec = importlib.util.spec_from_file_location("benchmark_script", ROOT / "scripts" / "benchmark.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    small = bench.parse(["--device", device, *s["SMALL"], "--schemes", *BENCH])
    base = bench.parse(["--device", device, *s["BASE"], "--schemes", "rope"])
    assert small.schemes == BENCH and small.compile and base.schemes == ["nope", "rope"]
    if device == "cuda":  # model=small at L=512, evaluated at 4L and 16L; model=base at L=1024; bf16 both
        assert (small.d_model, small.layers, small.heads, small.seq_len, small.lengths) == (512, 6, 8, 512, [2048, 8192])
        assert (base.d_model, base.layers, base.heads, base.seq_len) == (768, 12, 12, 1024)
        assert small.dtype == base.dtype == "bf16" and small.compile_backend == "inductor"
