"""Shared test setup: no network, no wandb, one data cache for the whole session, a CLI runner.

The environment is set at import time, before any test module imports posbench (whose CLI only
*defaults* these variables), so nothing in a test run can reach the Hugging Face Hub or wandb.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "disabled"

import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 300  # a subprocess that runs past this is a hang (or a bad input that started full training)


def pytest_configure(config):
    config.addinivalue_line("markers", "install: builds a non-editable install into a fresh venv (offline, ~20 s)")


def cli_env(**extra: str) -> dict:
    """The environment of every posbench subprocess: offline, wandb off, no source tree on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One posbench data cache for the session: the embedded corpus's tokenizer is trained once (~7 s)."""
    return tmp_path_factory.mktemp("posbench-cache")


@pytest.fixture(scope="session")
def run_cli(data_cache, tmp_path_factory):
    """``run_cli(*args, cwd=None)`` → CompletedProcess of ``python -m posbench *args`` (text, captured).

    Runs from a scratch working directory (never the repo) with ``POSBENCH_CACHE`` pointing at the
    session cache; callers still pass ``data.cache_dir=...`` explicitly.
    """
    scratch = tmp_path_factory.mktemp("cli-cwd")

    def run(*args: str, cwd: Path | None = None, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "posbench", *map(str, args)], cwd=cwd or scratch,
                              env=cli_env(POSBENCH_CACHE=str(data_cache)), capture_output=True, text=True,
                              timeout=timeout)

    return run


@pytest.fixture(scope="session")
def trained_run(run_cli, data_cache, tmp_path_factory) -> Path:
    """A finished ``posbench train debug=fast`` run folder (trained once per session)."""
    run_dir = tmp_path_factory.mktemp("runs") / "fast"
    proc = run_cli("train", "debug=fast", f"hydra.run.dir={run_dir}", f"data.cache_dir={data_cache}")
    assert proc.returncode == 0, f"debug=fast run failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return run_dir


@pytest.fixture
def existing_run(trained_run, tmp_path) -> Path:
    """A private copy of the finished debug=fast run (4 steps, states and checkpoint.pt) to point commands at."""
    run = tmp_path / "existing"
    shutil.copytree(trained_run, run)
    time.sleep(0.02)  # a rewrite from now on gets a later mtime
    return run


@pytest.fixture
def torch_state():
    """train() in process sets threads, deterministic mode and the RNG: put them back afterwards."""
    import torch

    threads, det, rng = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), torch.get_rng_state()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det)
    torch.set_rng_state(rng)
