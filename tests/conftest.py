"""Shared test setup: no network, no wandb, one data cache for the whole session, a CLI runner in a subprocess and
one in this process.

The environment is set at import time, before any test module imports posbench (whose CLI only
*defaults* these variables), so nothing in a test run can reach the Hugging Face Hub or wandb.
What test modules share besides fixtures is in tests/helpers.py.
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

from helpers import CLI_TIMEOUT_S, cli_env, kept_torch_state, posbench  # noqa: E402,F401  (re-exported: CLI_TIMEOUT_S, cli_env)


def pytest_configure(config):
    config.addinivalue_line("markers", "install: builds a non-editable install into a fresh venv (offline, ~20 s)")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One posbench data cache for the session, prepared here in process on first use (the embedded corpus's
    tokenizer is trained once, ~7 s), so runs started side by side find it ready. Its folder is the session's
    ``posbench-data``, the one torchrun and submitit jobs are given too."""
    from helpers import compose_train
    from posbench.config.schema import to_dict
    from posbench.data import cache

    root = tmp_path_factory.getbasetemp() / "posbench-data"
    root.mkdir(exist_ok=True)
    cache.prepare(**to_dict(compose_train(root))["data"])
    return root


@pytest.fixture(scope="session")
def run_cli(data_cache, tmp_path_factory):
    """``run_cli(*args, cwd=None)`` → CompletedProcess of ``python -m posbench *args`` (text, captured).

    Runs from a scratch working directory (never the repo) with ``POSBENCH_CACHE`` pointing at the
    session cache; callers still pass ``data.cache_dir=...`` explicitly.
    """
    scratch = tmp_path_factory.mktemp("cli-cwd")

    def run(*args: str, cwd: Path | None = None, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
        return posbench(*args, cwd=cwd or scratch, env=cli_env(POSBENCH_CACHE=str(data_cache)), timeout=timeout)

    return run


@pytest.fixture
def posbench_here(data_cache, tmp_path_factory, monkeypatch, capsys):
    """``posbench_here(*args)`` → CompletedProcess of ``posbench *args`` run in this process by ``posbench.cli.main``
    (exit status from its SystemExit, stdout and stderr as captured), for the refusals that come before Hydra starts
    a job: every job of the command line is composed and prepared first (``posbench.jobs.command.prepare_all``), and a bad
    one stops the command there with its one line and exit status 2. Hydra's job itself is replaced by a line
    saying it started, so a command that is not refused exits 0 without training, and ``helpers.refused`` fails
    on it. Milliseconds instead of a subprocess's seconds of start-up: one subprocess test per kind of refusal
    keeps the process-level contract (no traceback, nothing else on stderr).

    Runs in a scratch working directory with ``POSBENCH_CACHE`` at the session cache, and without the datasets
    library's progress bars (as in a posbench process whose stderr is not a terminal); the environment, sys.argv,
    the progress bars, the folder locks taken and the parent options put into Hydra's ConfigStore are put back
    afterwards.
    """
    import datasets

    from posbench import cli
    from posbench.jobs import command
    from posbench.runtime import gpus, runlock

    held_before = set(runlock.HELD)
    monkeypatch.chdir(tmp_path_factory.mktemp("here-cwd"))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("POSBENCH_CACHE", str(data_cache))
    for name in ("POSBENCH_RUN_STAMP", "POSBENCH_SWEPT", gpus.LOCK_DIR_ENV):
        monkeypatch.delenv(name, raising=False)

    def started(command):
        def task():
            print(f"posbench-test: Hydra started the {command} job: nothing refused the command line before it",
                  file=sys.stderr)
        return task

    for name, (_, config_name) in list(cli.COMMANDS.items()):
        monkeypatch.setitem(cli.COMMANDS, name, (started(name), config_name))

    def run(*args) -> subprocess.CompletedProcess:
        argv = [str(a) for a in args]
        capsys.readouterr()
        try:
            cli.main(argv)
            status = 0
        except SystemExit as e:
            status = 0 if e.code is None else e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["posbench", *argv], status, out, err)

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    yield run
    if bars:
        datasets.enable_progress_bars()
    for folder in set(runlock.HELD) - held_before:
        runlock.release(folder)
    command.PREPARED.clear()
    command.HELD.clear()
    command.inherit([])  # drops the parent options an init_from command line stored in Hydra's ConfigStore


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
    with kept_torch_state():
        yield
