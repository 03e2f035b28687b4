"""Sweeps over many GPUs, checked on a CPU: the one-GPU-per-job locks, the joblib and SLURM presets.

GPUs are fake ids in CUDA_VISIBLE_DEVICES (hold_gpu only locks files and sets the variable); the SLURM
preset is checked on the sbatch script submitit would submit, with sbatch itself never called.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from posbench.runtime import gpus


@pytest.mark.parametrize("env, expected", [
    ("0,2", ["0", "2"]),
    (" GPU-aa , GPU-bb ", ["GPU-aa", "GPU-bb"]),
    ("MIG-1a2b", ["MIG-1a2b"]),
    ("0,-1,2", ["0"]),  # like CUDA: the list ends at the first invalid entry
    ("", []),
    ("-1", []),
])
def test_visible_devices_reads_cuda_visible_devices(monkeypatch, env, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert gpus.visible_devices() == expected
    assert gpus.count_gpus() == max(1, len(expected))


def test_no_gpus_is_a_no_op(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with gpus.hold_gpu(tmp_path) as device:
        assert device is None
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert list(tmp_path.iterdir()) == []


def test_hold_sets_and_restores_cuda_visible_devices(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "a,b")
    with gpus.hold_gpu(tmp_path) as device:
        assert device == "a" and os.environ["CUDA_VISIBLE_DEVICES"] == "a"
        with gpus.hold_gpu(tmp_path) as again:  # re-entrant: no second lock, no deadlock
            assert again == "a"
        assert gpus._try_lock(tmp_path / "gpu-a.lock") is None  # locked against every other open file
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "a,b"


def test_timeout_when_every_gpu_is_taken(tmp_path):
    held = gpus._try_lock(tmp_path / "gpu-a.lock")
    try:
        with pytest.raises(TimeoutError, match="no GPU of a came free"):
            with gpus.hold_gpu(tmp_path, devices=["a"], poll_s=0.01, timeout_s=0.05):
                pass
    finally:
        held.close()
    with gpus.hold_gpu(tmp_path, devices=["a"], timeout_s=0.05) as device:  # free again once closed
        assert device == "a"


def test_a_process_with_cuda_waits_for_its_own_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(gpus, "_last", "b")
    monkeypatch.setattr(gpus, "_cuda_initialised", lambda: True)
    held = gpus._try_lock(tmp_path / "gpu-b.lock")
    try:
        with pytest.raises(TimeoutError):  # "a" is free, but this process's CUDA context is on "b"
            with gpus.hold_gpu(tmp_path, devices=["a", "b"], poll_s=0.01, timeout_s=0.05):
                pass
    finally:
        held.close()
    monkeypatch.setattr(gpus, "_cuda_initialised", lambda: False)
    with gpus.hold_gpu(tmp_path, devices=["a", "b"]) as device:
        assert device == "b"  # still preferred when free


def _job(lock_dir: str, barrier, results) -> None:
    """One sweep job in a fresh process: hold a GPU, record (gpu, what CUDA would see, start, end)."""
    barrier.wait()  # all jobs ask at once
    with gpus.hold_gpu(lock_dir, poll_s=0.01) as device:
        start = time.monotonic()
        seen = os.environ["CUDA_VISIBLE_DEVICES"]
        time.sleep(0.25)
        end = time.monotonic()
    results.put((os.getpid(), device, seen, start, end))


def _assert_exclusive(runs: list[tuple[str, float, float]], devices: set[str]) -> None:
    """No two (device, start, end) intervals on one device overlap; every device was used."""
    assert {d for d, _, _ in runs} == devices
    for device in devices:
        spans = sorted((s, e) for d, s, e in runs if d == device)
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, f"two jobs held {device} at once"


def test_five_jobs_share_two_gpus_one_at_a_time(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "gpu0,GPU-1b2c")  # spawned children inherit it
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(5), ctx.Queue()
    procs = [ctx.Process(target=_job, args=(str(tmp_path), barrier, results)) for _ in range(5)]
    for p in procs:
        p.start()
    records = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=10)
        assert p.exitcode == 0
    assert len({pid for pid, *_ in records}) == 5  # every job ran
    assert all(seen == device for _, device, seen, _, _ in records)  # each saw exactly its one GPU
    _assert_exclusive([(d, s, e) for _, d, _, s, e in records], {"gpu0", "GPU-1b2c"})


def _work(lock_dir: str, jobs, done) -> None:
    """A joblib worker: runs the jobs sent on ``jobs`` (seconds to hold a GPU; None ends it) one after another,
    putting (gpu, start, end) on ``done`` after each. Its jobs "initialise CUDA", so its first GPU is its own."""
    cuda = False
    gpus._cuda_initialised = lambda: cuda
    for hold_s in iter(jobs.get, None):
        try:
            with gpus.hold_gpu(lock_dir, poll_s=0.01, timeout_s=20) as device:
                cuda = True
                start = time.monotonic()
                time.sleep(hold_s)
                end = time.monotonic()
        except TimeoutError as e:
            device, start, end = repr(e), 0.0, 0.0
        done.put((device, start, end))


class _Worker:
    """A :func:`_work` process: ``send`` it jobs, ``result`` gives back what each put, in order."""

    def __init__(self, ctx, lock_dir) -> None:
        self.jobs, self.done = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=_work, args=(str(lock_dir), self.jobs, self.done))
        self.process.start()

    def send(self, hold_s: float = 0.0) -> None:
        self.jobs.put(hold_s)

    def result(self) -> tuple[str, float, float]:
        return self.done.get(timeout=60)

    def run(self) -> str:
        """Run one job and return its GPU."""
        self.send()
        return self.result()[0]

    def stop(self) -> None:
        self.jobs.put(None)
        self.process.join(timeout=10)
        if self.process.exitcode is None:
            self.process.kill()
        assert self.process.exitcode == 0


@pytest.fixture
def workers(tmp_path):
    """Start ``n`` :class:`_Worker` processes on the locks in ``tmp_path``; they are stopped after the test."""
    started = []

    def start(n: int) -> list[_Worker]:
        started.extend(_Worker(mp.get_context("spawn"), tmp_path) for _ in range(n))
        return started[-n:]

    yield start
    for worker in started:
        worker.stop()


def test_a_fresh_worker_takes_a_gpu_no_worker_is_bound_to(monkeypatch, workers):
    """Worker A ran a job on GPU a, and its CUDA context stays there. Both GPUs are free when worker B starts:
    B must take b, not a, or A's next job would wait for a while b idles."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "a,b")  # spawned children inherit it
    first, second = workers(2)
    assert first.run() == "a"
    assert second.run() == "b"
    assert first.run() == "a" and second.run() == "b"


def test_more_workers_than_gpus_share_the_bound_ones(monkeypatch, workers):
    """Three workers on two GPUs: once both GPUs are bound, the third worker takes a bound one, and the
    workers bound to a GPU take turns on it; every job runs."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "a,b")
    started = workers(3)
    own = [worker.run() for worker in started]  # one at a time: each is bound to the GPU of its first job
    assert own[:2] == ["a", "b"] and own[2] in {"a", "b"}
    for _ in range(2):
        for worker in started:  # then all at once, twice
            worker.send(0.2)
    runs = [(own[i], worker.result()) for i, worker in enumerate(started) for _ in range(2)]
    assert all(device == gpu for gpu, (device, _, _) in runs), runs
    _assert_exclusive([(device, start, end) for _, (device, start, end) in runs], {"a", "b"})


def test_a_lock_on_a_deleted_lock_file_is_not_trusted(monkeypatch, tmp_path):
    """A cleaner deletes gpu-a.lock after hold_gpu opened it, and another process makes and locks a new
    gpu-a.lock: the old file's lock comes free at once but guards nothing, so hold_gpu must not hold a."""
    path = tmp_path / "gpu-a.lock"
    flock, other = fcntl.flock, []

    def flock_after_a_clean(f, how):
        if getattr(f, "name", None) == str(path) and not other:
            os.unlink(path)
            other.append(open(path, "a+"))
            flock(other[0], fcntl.LOCK_EX)
        flock(f, how)

    monkeypatch.setattr(fcntl, "flock", flock_after_a_clean)
    try:
        with pytest.raises(TimeoutError):
            with gpus.hold_gpu(tmp_path, devices=["a"], poll_s=0.01, timeout_s=0.1):
                pass
    finally:
        other[0].close()


@pytest.mark.skipif(shutil.which("systemd-tmpfiles") is None, reason="needs systemd-tmpfiles")
def test_systemd_tmpfiles_keeps_the_locks_of_a_held_gpu(tmp_path):
    """An age-based clean of the temp folder (systemd-tmpfiles, as for /tmp) keeps the lock folder while a
    GPU is held, so no other process can make a new gpu-a.lock and hold a too."""
    temp, config = tmp_path / "tmp", tmp_path / "clean.conf"
    locks = temp / "posbench-gpus"
    config.write_text(f"d {temp} - - - mM:1h\n")  # by modification time alone: a ctime cannot be set back
    with gpus.hold_gpu(locks, devices=["a"]):
        (temp / "stale").touch()
        for path in [temp / "stale", *locks.iterdir(), locks]:
            os.utime(path, (0, 0))  # last touched in 1970
        clean = subprocess.run(["systemd-tmpfiles", "--clean", str(config)], capture_output=True, text=True, timeout=30)
        if (temp / "stale").exists():
            pytest.skip(f"this systemd-tmpfiles cannot age files by mtime alone: {clean.stderr.strip()}")
        assert (locks / "gpu-a.lock").exists()
        assert gpus._try_lock(locks / "gpu-a.lock") is None


def test_default_lock_dir(monkeypatch, tmp_path):
    """$POSBENCH_GPU_LOCK_DIR, else $XDG_RUNTIME_DIR when it is a writable folder of the user's own, else tmp."""
    import tempfile

    monkeypatch.delenv(gpus.LOCK_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert gpus.default_lock_dir() == tmp_path / "posbench-gpus"
    monkeypatch.setenv(gpus.LOCK_DIR_ENV, str(tmp_path / "mine"))
    assert gpus.default_lock_dir() == tmp_path / "mine"
    monkeypatch.delenv(gpus.LOCK_DIR_ENV)
    tmp = os.path.join(tempfile.gettempdir(), f"posbench-gpus-{os.getuid()}")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    assert str(gpus.default_lock_dir()) == tmp
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert str(gpus.default_lock_dir()) == tmp
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)  # someone else's folder
    assert str(gpus.default_lock_dir()) == os.path.join(tempfile.gettempdir(), f"posbench-gpus-{os.getuid()}")


def test_job_gpu_holds_only_under_joblib(monkeypatch, tmp_path):
    from contextlib import nullcontext

    from omegaconf import OmegaConf

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "a,b")
    monkeypatch.setenv(gpus.LOCK_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    plugins = "hydra_plugins.hydra_{0}_launcher.{0}_launcher.{1}"
    joblib = OmegaConf.create({"launcher": {"_target_": plugins.format("joblib", "JoblibLauncher")}})
    slurm = OmegaConf.create({"launcher": {"_target_": plugins.format("submitit", "SlurmLauncher")}})
    with gpus.job_gpu(joblib) as device:
        assert device == "a" and os.environ["CUDA_VISIBLE_DEVICES"] == "a"
    assert isinstance(gpus.job_gpu(slurm), nullcontext)
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun: each rank picks cuda:LOCAL_RANK itself
    assert isinstance(gpus.job_gpu(joblib), nullcontext)


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_module

    from posbench.cli import register

    register()
    gpus.register()
    with initialize_config_module("posbench.conf", version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=True)


def test_joblib_preset_runs_as_many_jobs_as_gpus(monkeypatch):
    from hydra.utils import instantiate

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    cfg = _compose(["hydra/launcher=joblib"])
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "JoblibLauncher" and launcher.joblib["n_jobs"] == 3
    assert _compose(["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]).hydra.launcher.n_jobs == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert instantiate(cfg.hydra.launcher).joblib["n_jobs"] == 1  # no GPU: one job at a time


def test_compare_gpu_runs_one_job_per_gpu_each_holding_its_gpu(monkeypatch, tmp_path):
    """experiment=compare_gpu selects the joblib preset: as many jobs at a time as visible GPUs, and each job's entry
    (``gpus.job_gpu`` of its Hydra node, which posbench/cli.py's task enters) holds one GPU, locked and alone visible;
    hydra/launcher=basic still runs the jobs one after another, holding nothing."""
    from hydra.utils import instantiate

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.setenv(gpus.LOCK_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cfg = _compose(["experiment=compare_gpu"])
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "JoblibLauncher" and launcher.joblib["n_jobs"] == 3
    assert cfg.model.name == "small" and cfg.train.seq_len == 512  # the experiment's own settings still apply
    with gpus.job_gpu(cfg.hydra) as device:
        assert device == "0" and os.environ["CUDA_VISIBLE_DEVICES"] == "0"
        assert gpus._try_lock(tmp_path / "gpu-0.lock") is None  # leased: locked against every other job
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    basic = _compose(["experiment=compare_gpu", "hydra/launcher=basic"])
    assert basic.hydra.launcher._target_.endswith("BasicLauncher")
    with gpus.job_gpu(basic.hydra) as device:
        assert device is None and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2"


class _Submitted(Exception):
    """Raised instead of calling sbatch; carries the script and the executor's requeue budget."""


def _submit(monkeypatch, overrides: list[str], jobs: list[list[str]]):
    """Launch ``jobs`` with the SLURM preset up to sbatch; return (sbatch script, max_num_timeout, config)."""
    import submitit
    from hydra.utils import instantiate

    def fake_sbatch(self, command):
        raise _Submitted(self._make_submission_file_text(command, "uid"), self.max_num_timeout)

    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 2))  # "srun is here"
    monkeypatch.setattr(submitit.SlurmExecutor, "_submit_command", fake_sbatch)
    cfg = _compose(["hydra/launcher=slurm", *overrides])
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "SlurmLauncher"
    launcher.setup(hydra_context=None, task_function=None, config=cfg)
    with pytest.raises(_Submitted) as submitted:
        launcher.launch(jobs, initial_job_idx=0)  # the plugin's own path: executor, pickles, sbatch script
    return (*submitted.value.args, cfg)


def test_slurm_preset_writes_the_sbatch_script(monkeypatch, tmp_path):
    script, max_num_timeout, _ = _submit(
        monkeypatch, ["hydra.launcher.partition=gpu", "hydra.launcher.gpus_per_node=2", "hydra.launcher.timeout_min=90",
                      f"hydra.sweep.dir={tmp_path}/sweep"], [["seed=0"], ["seed=1"]])
    lines = set(script.splitlines())
    for line in ("#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=2", "#SBATCH --time=90",
                 "#SBATCH --signal=USR2@120", "#SBATCH --requeue", "#SBATCH --cpus-per-task=8",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --array=0-1%2", "#SBATCH --job-name=train"):
        assert line in lines, f"{line!r} not in\n{script}"
    assert max_num_timeout == 20  # requeues after a timeout
    assert f"{tmp_path}/sweep/.submitit/" in script


def test_requeued_job_runs_in_the_same_folder(monkeypatch, tmp_path):
    """A requeue re-runs the pickled submission (the launcher's checkpoint() returns the same call); Hydra's
    ${now:} is cached inside the pickled config, so hydra.sweep.dir, and with it the run folder where the
    checkpoint lies, is the one of the first submission even minutes later."""
    import cloudpickle  # what submitit pickles with
    from hydra.core.utils import setup_globals

    monkeypatch.chdir(tmp_path)
    setup_globals()  # Hydra's ${now:} resolver
    _submit(monkeypatch, [], [["seed=3"]])  # the default sweep dir: multirun/<date>/<time>
    [sweep] = [p.parent for p in tmp_path.glob("multirun/*/*/.submitit")]
    [pickled] = (sweep / ".submitit").glob("*.pkl")
    time.sleep(1.1)  # ${now:%H-%M-%S} ticks
    with open(pickled, "rb") as f:
        submitted = cloudpickle.load(f)
    requeued = cloudpickle.loads(cloudpickle.dumps(submitted.function.checkpoint(*submitted.args)))
    assert requeued.args[:3] == (["seed=3"], "hydra.sweep.dir", 0)
    assert tmp_path / str(requeued.function.config.hydra.sweep.dir) == sweep


APP = textwrap.dedent("""
    import json, os, time
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from posbench import cli
    from posbench.config import schema  # (registers ${posbench_times:})
    from posbench.runtime import gpus

    @hydra.main(config_path="pkg://posbench.conf", config_name="train", version_base="1.3")
    def task(cfg):
        with gpus.job_gpu(HydraConfig.get()) as device:
            start = time.monotonic()
            seen = os.environ["CUDA_VISIBLE_DEVICES"]
            started = os.environ["STARTED_DIR"]  # hold the GPU until a second job runs beside this one,
            open(os.path.join(started, str(cfg.seed)), "w").close()  # so a slow-starting worker can't
            deadline = time.monotonic() + 30  # leave all five jobs to the first one
            while len(os.listdir(started)) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
            record = dict(device=device, seen=seen, pid=os.getpid(), start=start, end=time.monotonic())
        with open(os.path.join(HydraConfig.get().runtime.output_dir, "gpu.json"), "w") as f:
            json.dump(record, f)

    if __name__ == "__main__":
        cli.register()
        gpus.register()
        task()
""")


def test_joblib_sweep_end_to_end(tmp_path):
    """A real `-m hydra/launcher=joblib` sweep of 5 jobs on 2 fake GPUs: loky workers run several jobs each."""
    app = tmp_path / "app.py"
    app.write_text(APP)
    (tmp_path / "started").mkdir()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "g0,g1", gpus.LOCK_DIR_ENV: str(tmp_path / "locks"),
           "STARTED_DIR": str(tmp_path / "started")}
    env.pop("LOCAL_RANK", None)
    sweep = tmp_path / "sweep"
    out = subprocess.run([sys.executable, str(app), "-m", "hydra/launcher=joblib", "seed=0,1,2,3,4",
                          f"hydra.sweep.dir={sweep}", "~hydra.callbacks.report"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "n_jobs=2" in out.stdout + out.stderr  # one worker per GPU
    assert "validated against ConfigStore schema" not in out.stderr
    records = [json.loads(p.read_text()) for p in sweep.glob("*/gpu.json")]
    assert len(records) == 5
    assert all(r["seen"] == r["device"] for r in records)
    _assert_exclusive([(r["device"], r["start"], r["end"]) for r in records], {"g0", "g1"})
