"""A non-editable install finds its Hydra configs (conf/ shipped as posbench.conf) from any working directory.

Builds the package from a copy of this checkout into a fresh virtual environment, offline
(``--no-deps --no-build-isolation --no-index``): the venv sees the dependencies of the interpreter running
the tests (torch, hydra, setuptools, ...) through a .pth file, never the source tree. Then runs the
venv's ``posbench`` console script from a scratch directory.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_PARTS = ["pyproject.toml", "README.md", "LICENSE", "posbench", "conf"]


def run(cmd, cwd, timeout=300, **extra):
    """Run offline with wandb off and no PYTHONPATH (nothing may point back at the source tree)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", **extra)
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, venv bin folder, scratch cwd): posbench installed non-editable from a copy of the repo."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    for part in SOURCE_PARTS:  # a copy, so the build's build/ and *.egg-info never land in the checkout
        p = REPO / part
        if p.is_dir():
            shutil.copytree(p, src / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif p.is_file():
            shutil.copy2(p, src / part)
    env_dir = root / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / ("python.exe" if os.name == "nt" else "python")
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root).stdout.strip())
    # The dependencies of the interpreter running the tests (in CI a venv of its own, not the system's):
    # plain path lines, so that any editable-install hook of posbench in there is NOT activated.
    parent = [p for p in {*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
              if Path(p).is_dir()]
    (purelib / "_posbench_test_parent.pth").write_text("\n".join(sorted(parent)) + "\n")
    proc = run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                "--disable-pip-version-check", "-q", src], root, timeout=300, PIP_NO_INDEX="1")
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
    shutil.rmtree(src)  # nothing of the source may be needed from here on
    cwd = root / "elsewhere"
    cwd.mkdir()
    return python, bin_dir, cwd, env_dir


@pytest.mark.install
def test_installed_copy_is_imported(installed):
    python, _, cwd, env_dir = installed
    proc = run([python, "-c", "import posbench, posbench.conf, sys; print(posbench.__file__); print(posbench.conf.__file__)"],
               cwd)
    assert proc.returncode == 0, proc.stderr
    for line in proc.stdout.split():
        path = Path(line).resolve()
        assert env_dir.resolve() in path.parents, f"{path} is not inside the venv {env_dir}"
        assert REPO not in path.parents, f"{path} comes from the source tree"
    conf = Path(proc.stdout.split()[1]).parent
    assert (conf / "train.yaml").is_file() and (conf / "scheme" / "learned_16k.yaml").is_file()


@pytest.mark.install
def test_installed_console_script_composes_config(installed):
    _, bin_dir, cwd, _ = installed
    proc = run([bin_dir / "posbench", "train", "--cfg", "job"], cwd)
    assert proc.returncode == 0, proc.stderr
    for expected in ("scheme:", "name: rope", "model:", "name: tiny", "data:", "name: shakespeare", "seq_len: 128"):
        assert expected in proc.stdout, f"{expected!r} missing from:\n{proc.stdout}"
    proc = run([bin_dir / "posbench", "train", "scheme=alibi", "model=small", "debug=fast", "--cfg", "job"], cwd)
    assert proc.returncode == 0, proc.stderr
    assert "name: alibi" in proc.stdout and "name: small" in proc.stdout and "seq_len: 32" in proc.stdout
    proc = run([bin_dir / "posbench", "train", "scheme=noscheme"], cwd)  # the group's options are listed from the install
    assert proc.returncode == 2 and "alibi" in proc.stderr and "sinusoidal" in proc.stderr, proc.stderr
    assert not (cwd / "outputs").exists()


@pytest.mark.install
def test_installed_console_script_trains(installed, data_cache):
    _, bin_dir, cwd, _ = installed
    run_dir = cwd / "run"
    proc = run([bin_dir / "posbench", "train", "debug=fast", f"hydra.run.dir={run_dir}", f"data.cache_dir={data_cache}"],
               cwd, POSBENCH_CACHE=str(data_cache))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rec = json.loads((run_dir / "results.json").read_text())
    assert [r["length"] for r in rec["results"]] == [32, 64]
