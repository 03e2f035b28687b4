"""What the test modules share, one meaning per name. Test modules import from here (or take conftest's fixtures),
never from one another.

A posbench subprocess
    cli_env(**extra)            the environment of every posbench subprocess: offline, wandb off, no PYTHONPATH
    posbench(*args, cwd=...)    ``python -m posbench *args`` → CompletedProcess (text, captured), not checked
    ok(proc)                    ``proc``, after checking it exited 0 (its output in the failure message)
    run_into(run_cli, data_cache, run_dir, *overrides)   ``posbench train debug=fast … hydra.run.dir=run_dir``
    free_port()                 a TCP port free on 127.0.0.1 now (torchrun's MASTER_PORT)

A refusal (exit status 2, one line ``posbench: error: …`` on stderr, no traceback, the folder given untouched)
    refused(proc, folder, before)   checks all of it; returns the message, the folder's path written ``<run>``
    (conftest's ``posbench_here`` fixture runs the same command line in this process, for the message alone)

A folder
    snapshot(folder)            every file and folder under ``folder``, itself included → (mtime_ns, size, sha256):
                                equal snapshots mean nothing was created, removed, rewritten or touched
    file_states(folder)         every file under ``folder`` (folders not listed) → (mtime_ns, sha256)
    changes(before, after)      the paths whose entries differ between two snapshots (or file_states)

A run folder
    rows(run), steps_of(run)    metrics.jsonl's rows (a torn last line skipped), their steps
    valid_states(run)           the steps of the training states whose recorded checksum matches the file
    compose_train(cache, *overrides)   the composed ``posbench train debug=fast`` config (Hydra's compose API)
    train_here(cache, run, *overrides) that config's job prepared and trained in this process, into ``run``
    eval_here(*overrides)       ``posbench eval *overrides``'s job prepared and run in this process
    kept_torch_state()          a block after which torch's threads, deterministic mode and RNG are as before

References written from the papers, shared by several modules
    yarn_frequencies(dim, s, L, ...)   YaRN's inverse frequencies as its reference code computes them
    rope_tables(positions, angle, ...) RoPE's (cos, sin) tables in the layout posbench's rotary scheme uses
    wilson(k, n)                       the Wilson score interval of k successes in n trials
    t5_bucket_by_hand(n, B, M)         T5's causal bucket of distance n
    paper_bias(name, s, pos, ...)      the T5, KERPLE, Sandwich and FIRE biases as float64 tensors
    nll_with_scheme(folder, record, scheme)   a run's weights scored with a naive positional module
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 300  # a subprocess that runs past this is a hang (or a bad input that started full training)
PREFIX = "posbench: error: "


# ---- a posbench subprocess ------------------------------------------------------------------------------------


def cli_env(**extra: str) -> dict:
    """The environment of every posbench subprocess: offline, wandb off, no source tree on PYTHONPATH (the
    installed package is what runs), no HYDRA_FULL_ERROR or WANDB_DIR from the caller's shell; ``extra`` added."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR", "WANDB_DIR")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def posbench(*args, cwd: Path, env: dict | None = None, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``python -m posbench *args`` in ``cwd`` (text output captured); its exit status is the caller's to check."""
    return subprocess.run([sys.executable, "-m", "posbench", *map(str, args)], cwd=cwd, env=env or cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def ctrl_c_as_in_a_terminal() -> None:
    """``preexec_fn`` of a child the test will Ctrl-C: SIGINT's default action, as a command started from a terminal
    has it (pytest started as a background job, ``… &`` in a script, passes SIGINT on ignored, and Python and posbench
    keep an ignored SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def run_into(run_cli, data_cache, run_dir: Path, *overrides: str):
    """``posbench train debug=fast *overrides`` into ``run_dir`` with the session's data cache (``run_cli``: the
    conftest fixture, or ``posbench_here`` for a refusal checked in this process)."""
    return run_cli("train", "debug=fast", *overrides, f"hydra.run.dir={run_dir}", f"data.cache_dir={data_cache}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- a refusal ------------------------------------------------------------------------------------------------


def refused(proc, folder: Path, before: dict) -> str:
    """Check a refusal: exit status 2, no traceback, stderr exactly one line ``posbench: error: ...``, and
    ``folder`` as :func:`snapshot` found it ``before``. Returns the message after ``posbench: error: ``, with the
    folder's path replaced by ``<run>`` (so numbers in a temporary path are not taken for values)."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"exit status {proc.returncode}\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    lines = proc.stderr.strip("\n").splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{proc.stderr}"
    assert lines[0].startswith(PREFIX), lines[0]
    changed = changes(before, snapshot(folder))
    assert not changed, f"the refused command created or touched in {folder}: {changed}"
    return lines[0][len(PREFIX):].replace(str(folder), "<run>")


# ---- a folder -------------------------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def snapshot(folder: Path) -> dict:
    """Every file and folder under ``folder`` (itself included): relative path → (mtime_ns, size, sha256), a
    folder's size 0 and digest "dir". A missing ``folder`` is an empty snapshot."""
    if not folder.exists():
        return {}
    out = {}
    for p in [folder, *sorted(folder.rglob("*"))]:
        st = p.stat()
        out[str(p.relative_to(folder))] = (st.st_mtime_ns, st.st_size, sha256(p)) if p.is_file() else (st.st_mtime_ns, 0, "dir")
    return out


def file_states(folder: Path) -> dict:
    """Every file under ``folder`` (not the folders): relative path → (mtime_ns, sha256)."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, sha256(p)) for p in sorted(folder.rglob("*")) if p.is_file()}


def changes(before: dict, after: dict) -> list[str]:
    """The paths created, removed or changed between two snapshots (or two file_states)."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


# ---- a run folder ---------------------------------------------------------------------------------------------


def rows(run: Path) -> list[dict]:
    """metrics.jsonl rows; a last line still being written is skipped."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def steps_of(run: Path) -> list[int]:
    return [r["step"] for r in rows(run)]


def valid_states(run: Path) -> list[int]:
    """Steps of the training states (``checkpoints/step-*.pt``) whose recorded checksum matches the file."""
    out = []
    for path in sorted((run / "checkpoints").glob("step-*.pt")):
        sha = path.with_name(path.name + ".sha256")
        if sha.exists() and sha.read_text().strip() == sha256(path):
            out.append(int(path.stem.split("-")[1]))
    return out


def compose_train(cache: Path, *overrides: str):
    """The composed ``posbench train debug=fast data.cache_dir=cache *overrides`` config, not yet finalized."""
    from hydra import compose, initialize_config_module

    from posbench.cli import register

    register()
    with initialize_config_module("posbench.conf", version_base="1.3"):
        return compose("train", overrides=["debug=fast", f"data.cache_dir={cache}", *overrides])


def train_here(cache: Path, run: Path, *overrides: str) -> dict:
    """``posbench train debug=fast data.cache_dir=cache *overrides`` into ``run`` (made if missing), trained in this
    process: the job prepared and trained as the CLI's Hydra job trains it (posbench/jobs/train_job.py,
    posbench/training/loop.py),
    without Hydra's own files (``.hydra/``, train.log). Returns the results record. Sets torch's threads and RNG:
    callers restore them (conftest's ``torch_state``, :func:`kept_torch_state`)."""
    from posbench.jobs import train_job
    from posbench.training import loop

    run.mkdir(parents=True, exist_ok=True)
    return loop.train(train_job.prepare(compose_train(cache, *overrides), run))


def eval_here(*overrides: str) -> dict:
    """``posbench eval *overrides`` (``run=<folder>`` among them) in this process: the composed eval config prepared
    and run as the CLI's Hydra job runs it (posbench/jobs/eval_job.py), its eval-*.json / .csv written beside the run's
    results. Returns the record. Sets torch's threads: callers restore them (conftest's ``torch_state``)."""
    from hydra import compose, initialize_config_module

    from posbench.cli import register
    from posbench.jobs import eval_job

    register()
    with initialize_config_module("posbench.conf", version_base="1.3"):
        cfg = compose("eval", overrides=list(overrides))
    return eval_job.run(eval_job.prepare(cfg))


@contextmanager
def kept_torch_state():
    """train() in process sets threads, deterministic mode, the RNG and the flush of denormals: the block leaves them
    as it found them."""
    from posbench.runtime import device

    threads, det, rng = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), torch.get_rng_state()
    flushing = device._flushing
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)
        torch.set_rng_state(rng)
        device._flushing = flushing
        torch.set_flush_denormal(flushing)


# ---- references written from the papers -----------------------------------------------------------------------


def yarn_frequencies(dim, s, L, beta_fast=32.0, beta_slow=1.0, base=10000.0) -> list[float]:
    """The inverse frequencies of the YaRN reference code (jquesnelle/yarn: ``find_correction_dim``,
    ``find_correction_range``, ``linear_ramp_mask``; HF's ``_compute_yarn_parameters`` with truncate=True),
    restated here in python math: the pair whose angle turns r times over L is d·ln(L/(2π·r)) / (2·ln base); the ramp
    runs linearly in the pair index from ⌊that of β_fast⌋ (kept) to ⌈that of β_slow⌉ (interpolated by s)."""
    def pair(rotations):
        return dim * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(pair(beta_fast)), 0), min(math.ceil(pair(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(dim // 2):
        extrapolation = 1.0 / base ** (2 * i / dim)
        interpolation = 1.0 / (s * base ** (2 * i / dim))
        extrapolation_weight = 1 - min(1.0, max(0.0, (i - low) / (high - low)))
        out.append(interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight)
    return out


def rope_tables(positions, angle, mscale=1.0, dh=16):
    """(cos, sin) float64 (T, Dh) as ``RoPE.rotation`` lays them out: column i and i + Dh/2 hold pair i,
    the sine's first half negated; ``angle(p, i)`` is the method's angle of pair i at position p."""
    half = dh // 2
    cos = [[0.0] * dh for _ in positions]
    sin = [[0.0] * dh for _ in positions]
    for t, p in enumerate(positions):
        for i in range(half):
            a = angle(p, i)
            cos[t][i] = cos[t][i + half] = mscale * math.cos(a)
            sin[t][i], sin[t][i + half] = -mscale * math.sin(a), mscale * math.sin(a)
    return torch.tensor(cos, dtype=torch.float64), torch.tensor(sin, dtype=torch.float64)


def wilson(k, n, z=1.959963984540054):  # Wilson 1927, eq. for the score interval
    p = k / n
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def t5_bucket_by_hand(n: int, B: int, M: int) -> int:
    """T5's causal bucket of distance n: B/2 exact buckets, then B/2 log-spaced ones up to M, the rest in the last."""
    n = max(n, 0)
    exact = B // 2
    if n < exact:
        return n
    return min(B - 1, exact + math.floor(math.log(n / exact) / math.log(M / exact) * (B - exact)))


def paper_bias(name: str, s, pos: torch.Tensor, heads: int | None = None, head_dim: int | None = None) -> torch.Tensor:
    """(H, T, T) float64 bias of query i = pos[a] and key j = pos[b] (any value above the diagonal) of the relative
    scheme ``s`` named ``name`` (t5, kerple_log, kerple_power, sandwich, fire), from the papers' formulas
    (tests/test_relative.py's docstring lists them); gradients reach the scheme's parameters. Sandwich, which has no
    parameters to read them from, needs ``heads`` and ``head_dim`` (d̄ when its code width is unset)."""
    i, j = pos.double()[:, None], pos.double()[None, :]  # (T, 1), (1, T)
    d = i - j  # (T, T)
    if name == "t5":
        B, M = s.config.num_buckets, s.config.max_distance
        idx = torch.tensor([[t5_bucket_by_hand(int(x), B, M) for x in row] for row in (pos[:, None] - pos[None, :])])
        return s.weight.double()[idx].permute(2, 0, 1)  # (H, T, T)
    if name in ("kerple_log", "kerple_power"):
        r1 = torch.log1p(torch.exp(s.theta1.double()))[:, None, None]  # (H, 1, 1)
        if name == "kerple_log":
            r2 = torch.log1p(torch.exp(s.theta2.double()))[:, None, None]
            return -r1 * torch.log(1 + r2 * d.abs())
        r2 = 2 / (1 + torch.exp(-s.theta2.double()))[:, None, None]
        return -r1 * d.abs() ** r2
    if name == "sandwich":
        H, dbar = heads, s.config.dim or head_dim
        k = torch.arange(1, dbar // 2 + 1, dtype=torch.float64)
        total = torch.cos(d[..., None] / 10000 ** (2 * k / dbar)).sum(-1)  # (T, T)
        return (total - dbar / 2) / (8 * torch.arange(1, H + 1, dtype=torch.float64) / H)[:, None, None]
    if name == "fire":
        c, m = s.c.double(), s.multiplier.double()
        threshold = (m * s.config.threshold).abs()
        x = torch.log(torch.abs(c * d) + 1) / (torch.log(torch.abs(c * torch.maximum(i, threshold)) + 1) + 1e-6)
        hidden = torch.relu(x[..., None] * s.mlp[0].weight.double()[:, 0] + s.mlp[0].bias.double())  # (T, T, W)
        return (hidden @ s.mlp[2].weight.double().T + s.mlp[2].bias.double()).permute(2, 0, 1)  # (H, T, T)
    raise KeyError(name)


def nll_with_scheme(folder: Path, record: dict, scheme: torch.nn.Module) -> list[float]:
    """The NLL at lengths 32 and 64 (256 validation tokens: ``debug=fast``'s evaluation) of the run in ``folder``:
    its trained weights (checkpoint.pt) loaded into a GPT whose positional module is ``scheme``, a naive module
    written in the test from its paper; ``record``: the run's (or a re-evaluation's) results record, for the data."""
    from posbench.data import cache
    from posbench.evaluation.perplexity import evaluate
    from posbench.model.gpt import GPT

    state = torch.load(folder / "checkpoint.pt", weights_only=True)
    m = state["spec"]["model"]
    model = GPT(state["vocab_size"], m["n_layer"], m["n_head"], m["d_model"], m["d_ff"], scheme, dropout=m["dropout"],
                scale_embeddings=m["scale_embeddings"])
    model.load_state_dict(state["model"])
    tokens = cache.prepare(**record["config"]["data"]).tokens["validation"]
    return [r["nll"] for r in evaluate(model.eval(), tokens, [32, 64], max_tokens=256)]
