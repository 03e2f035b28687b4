"""posbench/model/memory.py against measurement and independent formulas: the peak RSS of a real training step in a fresh
process, the quadratic growth of the dense kernel's attention, the refusal message, and the host's memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posbench.model import memory
from posbench.runtime import free_memory

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30
TINY = {"n_layer": 4, "n_head": 4, "d_model": 128, "d_ff": 512, "dropout": 0.0, "scale_embeddings": True}
V = 4096


def tiny(scheme: str, extra: dict | None = None) -> dict:
    return {"vocab_size": V, "model": {**TINY, **(extra or {})}, "scheme": {"name": scheme}}


# One step in a fresh process: the RSS the step adds at its peak over the process's RSS after imports, model,
# optimizer and batch. The peak is VmHWM of /proc/self/status, reset first by writing 5 to /proc/self/clear_refs
# (ru_maxrss would not do: Linux keeps it across fork and exec, so it starts at the parent's size, pytest's).
STEP = """
import json, re, sys, torch
torch.set_num_threads(2)
from posbench.model.build import build_model
scheme, B, T, training = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "train"
extra = json.loads(sys.argv[5])  # model options beside model=tiny's sizes (the Llama block's)

def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

model = build_model({"vocab_size": 4096, "model": {"n_layer": 4, "n_head": 4, "d_model": 128, "d_ff": 512, **extra},
                     "scheme": {"name": scheme}}).train(training)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.zeros(1, 16, dtype=torch.long), targets=torch.zeros(1, 16, dtype=torch.long)).sum().backward()
optimizer.zero_grad(set_to_none=True)  # a warm-up: torch's one-time set-up (thread pool, kernels) is not the step's
x, y = torch.randint(4096, (B, T)), torch.randint(4096, (B, T))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark starts again from the current RSS
before, high_before = status("VmRSS"), status("VmHWM")
if training:
    loss = model(x, targets=y).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
else:
    with torch.no_grad():
        model(x, targets=y)
print(json.dumps({"before": before, "high_before": high_before, "peak": status("VmHWM")}))
"""


def measured_step(scheme: str, B: int, T: int, mode: str, extra: dict | None = None) -> int:
    """Bytes of RSS one step adds at its peak, measured in a fresh interpreter (``extra``: model options)."""
    out = subprocess.run([sys.executable, "-c", STEP, scheme, str(B), str(T), mode, json.dumps(extra or {})], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["peak"] > r["high_before"], "the step did not raise the high-water mark: the measurement says nothing"
    return r["peak"] - r["before"]


LLAMA = {"block": "llama", "n_kv_head": 2, "head_dim": 48}  # SwiGLU, grouped-query heads wider than D / H


@pytest.mark.parametrize("scheme, B, T, mode, kernel, extra", [
    ("rope", 4, 1024, "train", "causal", None),  # measured ~300 MB, ~5 s on 2 cores
    ("t5", 2, 1024, "train", "dense", None),  # probabilities of 4 layers (128 MiB) dominate: ~330 MB, ~5 s
    ("rope", 32, 1024, "eval", "causal", None),  # no grad: one layer's tensors, ~200 MB, ~4 s
    ("kerple_log", 32, 1024, "eval", "banded", None),  # the same plus the output and a block's partials
    ("cope", 2, 1024, "train", "contextual", None),  # every pair's gates, positions, index, probabilities: ~1.4 GB, ~10 s
    ("rope", 4, 1024, "train", "causal", LLAMA),
    ("alibi", 32, 1024, "eval", "banded", LLAMA),
])
def test_estimate_within_factor_two_of_measured_peak(scheme, B, T, mode, kernel, extra):
    training = mode == "train"
    assert memory.kernel_for(scheme, "cpu", training) == kernel
    increase = measured_step(scheme, B, T, mode, extra)
    assert increase > 100 * 2**20, f"the step added only {increase / 2**20:.0f} MiB: too close to noise"
    parts = memory.step_bytes(tiny(scheme, extra), B, T, kernel, training=training, device="cpu")
    needed = parts["total"] - parts["weights"]  # the weights are in the RSS before the step
    print(f"{scheme} {mode} B={B} T={T}: measured {increase / 2**20:.0f} MiB, estimated {needed / 2**20:.0f} MiB")
    assert 0.5 * increase <= needed <= 2 * increase, (increase, parts)


def test_dense_attention_quadruples_with_doubled_length():
    B, H, L = 2, TINY["n_head"], TINY["n_layer"]
    spec = tiny("t5")
    small, large = (memory.step_bytes(spec, B, T, "dense")["attention"] for T in (512, 1024))
    assert 3.6 <= large / small <= 4.0, (small, large)  # T² terms, plus O(T) copies of q, k, v
    for T, got in ((512, small), (1024, large)):  # one query block (H·T² ≤ 2^24): the full T × T square
        # float32: the kept probabilities (one copy per layer), two block-sized temporaries, the (H, T, T) mask;
        # the rest is O(T) copies of q, k, v and the bias's graph (T5: 9 bytes per pair)
        expected = (B * H * T * T * (L + 2) + H * T * T) * 4
        assert expected <= got <= 1.2 * expected, (T, got, expected)


def test_dense_attention_counts_the_causal_triangle_at_long_lengths():
    """Past one block the kernel builds only keys 0…end of each query block: about half the square per layer."""
    B, H, L, T = 16, TINY["n_head"], TINY["n_layer"], 100_000
    got = memory.step_bytes(tiny("t5"), B, T, "dense")["attention"]
    triangle = B * H * T * T / 2 * L * 4
    assert triangle <= got <= 1.1 * triangle, (got, triangle)


def test_causal_attention_is_linear_in_length():
    spec = tiny("rope")
    a, b = (memory.step_bytes(spec, 16, T, "causal")["attention"] for T in (1000, 2000))
    assert b == 2 * a


def test_check_fits_refuses_a_long_run_with_the_figures(monkeypatch):
    monkeypatch.setattr(free_memory, "available_bytes", lambda device: (24 * GiB, "MemAvailable of /proc/meminfo"))
    what = "train.seq_len=100000 × train.batch_size=16"
    with pytest.raises(memory.MemoryTooSmall) as err:
        memory.check_fits(tiny("rope"), 16, 100_000, "causal", "cpu", what)
    message = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in message
    assert message.startswith(what + ": a training step needs about ")
    assert "24.0 GiB available (MemAvailable of /proc/meminfo)" in message
    assert message.endswith("lower train.seq_len or train.batch_size")
    # the figure: at least what the layers keep, L·B·T·(11·D + 2·F)·4 bytes, written independently here
    needed = float(message.split("needs about ")[1].split(" GiB")[0]) * GiB
    D, F = TINY["d_model"], TINY["d_ff"]
    assert needed >= TINY["n_layer"] * 16 * 100_000 * (11 * D + 2 * F) * 4


def test_check_fits_names_the_dense_kernel(monkeypatch):
    monkeypatch.setattr(free_memory, "available_bytes", lambda device: (24 * GiB, "MemAvailable of /proc/meminfo"))
    with pytest.raises(memory.MemoryTooSmall, match=r"TiB \(attention [0-9.]+ TiB with the dense kernel"):
        memory.check_fits(tiny("t5"), 16, 100_000, "dense", "cpu", "train.seq_len=100000 × train.batch_size=16")


@pytest.mark.parametrize("scheme", ["rope", "alibi", "t5", "learned"])
def test_check_fits_passes_the_demo_size(monkeypatch, scheme):
    monkeypatch.setattr(free_memory, "available_bytes", lambda device: (24 * GiB, "MemAvailable of /proc/meminfo"))
    spec = tiny(scheme)
    if scheme == "learned":
        spec["scheme"]["max_positions"] = 16 * 128
    memory.check_fits(spec, 16, 128, memory.kernel_for(scheme, "cpu", True), "cpu",
                      "train.seq_len=128 × train.batch_size=16")


def test_available_bytes_on_this_machine():
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free, what = free_memory.available_bytes("cpu")
    assert 0 < free <= physical
    if Path("/proc/meminfo").exists():
        assert "MemAvailable" in what or "cgroup" in what


def test_available_bytes_falls_back_to_physical_memory(monkeypatch):
    monkeypatch.setattr(free_memory, "_meminfo_available", lambda: None)
    monkeypatch.setattr(free_memory, "_cgroup_free", lambda: None)
    assert free_memory.available_bytes("cpu") == (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                                             "physical memory")


def test_parameter_count_matches_the_built_model():
    from posbench.model.build import build_model

    for scheme in ("rope", "t5", "fire"):
        spec = tiny(scheme)
        assert memory.parameter_count(spec, 128) == sum(p.numel() for p in build_model(spec).parameters())
    learned = {**tiny("learned"), "scheme": {"name": "learned", "max_positions": 2048}}
    assert memory.parameter_count(learned, 128) - memory.parameter_count(tiny("rope"), 128) == 2048 * TINY["d_model"]


def test_kernel_for_follows_the_attention_module():
    assert memory.kernel_for("rope", "cpu", True) == "causal"
    assert memory.kernel_for("alibi", "cpu", True) == "folded"
    assert memory.kernel_for("t5", "cpu", True) == "dense"
    assert memory.kernel_for("t5", "cuda", True, dropout=0.1) == "dense"


def test_residual_dropout_keeps_flexattention_and_attention_dropout_leaves_it(monkeypatch):
    """The memory check of a CUDA run picks the kernel by ``model.attn_dropout``, not ``model.dropout``: ALiBi under
    residual dropout alone keeps FlexAttention (as ``choice.choose_kernel`` picks it, from class attributes)."""
    import types

    import torch
    from hydra import compose, initialize_config_module

    from posbench.attention import choice, flex
    from posbench.cli import register
    from posbench.config.schema import finalize, to_dict
    from posbench.jobs import train_job
    from posbench.model import build
    from posbench.schemes import SCHEMES

    if flex.flex_attention is None:
        pytest.skip("FlexAttention needs torch >= 2.5")
    cuda = torch.device("cuda")
    assert choice.choose_kernel(SCHEMES["alibi"], cuda, torch.bfloat16, dropout=0.0, grad=True) == "flex"
    assert memory.kernel_for("alibi", "cuda", True, dropout=0.0) == "flex"
    assert memory.kernel_for("alibi", "cuda", True, dropout=0.1) == "dense"
    kernels = []  # (kernel, device) of each memory check

    def check_fits(spec, batch_size, seq_len, kernel, device, what, training=True, **_):  # each layer's, as it counts
        kernels.append((kernel or "/".join({k for k, _, _ in memory.layer_kernels(spec, device, training)}), str(device)))

    monkeypatch.setattr(memory, "check_fits", check_fits)
    register()
    for attn_dropout, kernel in ((0.0, "flex"), (0.1, "dense")):
        with initialize_config_module("posbench.conf", version_base="1.3"):
            cfg = finalize(compose("train", overrides=["scheme=alibi", "model.dropout=0.1",
                                                       f"model.attn_dropout={attn_dropout}", "train.device=cpu"]))
        cfg.train.device = "cuda"  # (finalize refuses cuda on a machine without it; the check only reads the name)
        train_job.check_memory(types.SimpleNamespace(config=cfg, spec=build.spec(to_dict(cfg), V)))
        assert kernels[-2:] == [(kernel, "cuda"), ("flex", "cuda")]  # the training step's; evaluation's never drops


def test_available_cuda_memory_counts_the_allocator_s_cache_as_free(monkeypatch):
    """``mem_get_info`` counts the blocks this process's caching allocator keeps reserved (an earlier job's, in a joblib
    worker) as used; reserved but unallocated, they are free to this process."""
    import torch

    asked = []

    def reading(value):
        return lambda device=None: asked.append(device) or value

    monkeypatch.setattr(torch.cuda, "mem_get_info", reading((3 * GiB, 80 * GiB)))  # (free, total)
    monkeypatch.setattr(torch.cuda, "memory_reserved", reading(10 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", reading(4 * GiB))
    free, what = free_memory.available_bytes("cuda:1")
    assert free == 3 * GiB + (10 - 4) * GiB and "cuda:1" in what
    assert asked == [torch.device("cuda:1")] * 3  # every figure of the run's own device


def test_training_fire_through_flex_counts_its_per_pair_tables(monkeypatch):
    """On CUDA FIRE trains through Flex with its bias of every (query, key) pair as a table (H, T, T) per layer (one
    FIRE per layer): the estimate counts at least the table and its gradient per layer, growing as T², while T5
    in the shared layout (a per-distance table of H·T values) adds nothing of the kind, and in the pair layout (flex's
    default) one table for its one instance."""
    model = {"n_layer": 3, "n_head": 4, "d_model": 64, "d_ff": 128}
    fire, t5 = ({"scheme": {"name": name}, "model": model, "vocab_size": 256} for name in ("fire", "t5"))
    assert memory.kernel_for("fire", "cuda", True) == "flex"
    at = {T: memory.step_bytes(fire, 2, T, "flex", 2, True, "cuda")["attention"] for T in (256, 512)}
    lse = 3 * 2 * 4 * 512 * memory.LSE_BYTES
    assert at[512] - lse >= 3 * 512 * 512 * 2 * 4 * 4  # three layers' tables and their gradients, float32
    assert 3.5 < (at[512] - lse) / (at[256] - lse / 2) < 4.5
    monkeypatch.setattr(memory.flex, "OPTIONS", memory.flex.Options("shared"))
    assert memory.step_bytes(t5, 2, 512, "flex", 2, True, "cuda")["attention"] == lse
    monkeypatch.setattr(memory.flex, "OPTIONS", memory.flex.Options("pair"))
    pair = memory.step_bytes(t5, 2, 512, "flex", 2, True, "cuda")["attention"] - lse
    assert 512 * 512 * 2 * 4 * 4 <= pair < 3 * 512 * 512 * 2 * 4 * 4  # one table and its gradient, not three


# ---- the check before a run: the refusal, and its switch ------------------------------------------------------


def test_a_step_that_cannot_fit_in_memory_is_refused_with_the_figures(posbench_here, data_cache, existing_run):
    """Terabytes of activations (100k tokens × 1024 sequences): no machine here has them; refused in seconds, not
    after an hour of swapping, by ``posbench train`` before it touches the run folder (helpers.refused)."""
    from helpers import refused, run_into, snapshot

    before = snapshot(existing_run)
    message = refused(run_into(posbench_here, data_cache, existing_run, "train.seq_len=100000", "train.batch_size=1024",
                               "eval.lengths=[64]"), existing_run, before)
    assert message.startswith("train.seq_len=100000 × train.batch_size=1024: a training step needs about ")
    assert "TiB" in message and "available" in message and "lower train.seq_len or train.batch_size" in message


def test_check_memory_false_skips_the_memory_check(data_cache, monkeypatch):
    from helpers import compose_train
    from posbench.config.checks import ConfigError
    from posbench.jobs import train_job

    monkeypatch.setattr(free_memory, "available_bytes", lambda device: (1 << 20, "a 1 MiB test machine"))
    cfg, off = (compose_train(data_cache, *extra) for extra in ([], ["train.check_memory=false"]))
    with pytest.raises(ConfigError, match=r"a 1 MiB test machine.*train\.check_memory=false"):
        train_job.prepare(cfg)
    assert train_job.prepare(off).config.train.check_memory is False


def test_a_run_of_0_steps_is_not_checked_for_a_training_step(data_cache, monkeypatch):
    """``train.steps=0`` (a parent evaluated as it is) takes no training step: only the evaluation's forward pass is
    checked, so a model whose training step would not fit is still evaluated (SmolLM2-135M's at L = 8192 on a CPU)."""
    import types

    from helpers import compose_train
    from posbench.config.schema import finalize, to_dict
    from posbench.jobs import train_job
    from posbench.model import build

    checked = []
    monkeypatch.setattr(memory, "check_fits", lambda *a, training=True, **k: checked.append(training))
    for steps in (0, 4):
        cfg = finalize(compose_train(data_cache, f"train.steps={steps}", "init_from=x", "train.device=cpu"))
        train_job.check_memory(types.SimpleNamespace(config=cfg, spec=build.spec(to_dict(cfg), V)))
    assert checked == [False, True, False]  # 0 steps: evaluation only; 4 steps: the step, then the evaluation
