"""What ``posbench eval`` says while it works (issue 28): each length and each probe's, logged to the console and
appended to the run's ``eval.log`` with what is evaluated and the file written; a tqdm bar over them on a terminal
(none off one, as training's); and "compiling the attention kernel for length T" when FlexAttention compiles (FIRE
evaluated on a CPU), only then. Evaluation scores without gradients (FIRE reaches Flex on a CPU only so).
"""

from __future__ import annotations

import fcntl
import logging
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading

import numpy as np
import pytest
import torch

from helpers import CLI_TIMEOUT_S, cli_env, run_into
from posbench.attention import dispatch, flex
from posbench.evaluation.perplexity import evaluate
from posbench.schemes import build_scheme

EVAL = ["eval.lengths=[32,64]", "eval.max_tokens=256"]
PROBES = ["eval.probes=[passkey,context]", "eval.passkey.trials=1", "eval.passkey.depths=[0]",
          "eval.context.windows=2", "eval.context.bootstrap=10"]
NO_FLEX = "FlexAttention does not compile on this CPU"


def messages(log_text: str) -> list[str]:
    """The messages of the ``posbench`` logger's lines in Hydra's format, in order."""
    return re.findall(r"^\[[^]]*\]\[posbench\]\[INFO\] - (.*)$", log_text, flags=re.M)


def on_a_terminal(*args: str, env: dict, cwd) -> tuple[subprocess.CompletedProcess, str]:
    """``python -m posbench *args`` with stderr on a pseudo-terminal of 120 columns and stdout captured: the process
    and what the terminal received."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    received: list[bytes] = []

    def drain():
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # (EIO: the terminal's last writer closed it)
                return
            if not chunk:
                return
            received.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.run([sys.executable, "-m", "posbench", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=slave, text=True, timeout=CLI_TIMEOUT_S)
    finally:
        os.close(slave)
        reader.join(10)
        os.close(master)
    return proc, b"".join(received).decode(errors="replace")


# ---- in process: no gradients, and the compile message where a compilation happens ---------------------------------


def test_evaluate_scores_without_gradients():
    """``evaluate`` runs the model with autograd off (with it on, FIRE on a CPU took the dense kernel, never Flex)."""

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.grad = torch.nn.Parameter(torch.zeros(())), []

        def forward(self, x, targets):
            self.grad.append(torch.is_grad_enabled())
            return self.w + torch.zeros(targets.shape)  # (B, T)

    model = Probe()
    evaluate(model, np.arange(100), [8, 16], max_tokens=32)
    assert model.grad and not any(model.grad)


def test_the_compile_message_comes_when_flex_compiles_and_only_then(caplog, monkeypatch):
    """A new shape logs "compiling the attention kernel for length T" once; the same call again, served by the
    compiled kernel, logs nothing; Dynamo's callback list is left as it was."""
    if flex.flex_attention is None:
        pytest.skip("torch.nn.attention.flex_attention is missing (torch < 2.5)")
    monkeypatch.setattr(flex, "cpu_compiles", True)
    monkeypatch.setattr(flex, "_compiled", None)
    flex.reset_compiled()
    torch.manual_seed(0)
    scheme, T = build_scheme("fire", d_model=32, n_head=4, threshold=8), 16  # (queries past L_thr)
    q, k, v = torch.randn(3, 1, 4, T, 8).unbind(0)  # (B, H, T, Dh) each
    callbacks = list(flex._compile_callbacks.start_callbacks)
    try:
        with torch.no_grad(), caplog.at_level(logging.INFO, logger="posbench"):
            ctx = dispatch.context(scheme, torch.arange(T), 4, kernel="flex")
            dispatch.attend(q, k, v, ctx)
            if not flex.cpu_compiles:
                pytest.skip(f"compiled FlexAttention does not run on this CPU: {caplog.text[-300:]}")
            first = [r.getMessage() for r in caplog.records]
            caplog.clear()
            dispatch.attend(q, k, v, ctx)
            again = [r.getMessage() for r in caplog.records]
    finally:
        flex.reset_compiled()
    assert first == [f"compiling the attention kernel for length {T}"]
    assert again == []
    assert flex._compile_callbacks.start_callbacks == callbacks


# ---- through the CLI --------------------------------------------------------------------------------------------


def test_posbench_eval_logs_what_it_does_into_eval_log(run_cli, existing_run):
    """Off a terminal: no bar; the console (stdout) and ``eval.log`` get what is evaluated, each length, each probe's
    length and the file written, in that order."""
    proc = run_cli("eval", f"run={existing_run}", *EVAL, *PROBES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = existing_run / "eval-rope-nonoverlapping-validation-1.json"
    assert written.is_file()
    want = [re.escape(f"evaluating rope ({existing_run}): lengths 32, 64, nonoverlapping, validation split ") + ".*",
            "evaluating at length 32", "evaluating at length 64", "passkey probe at length 32",
            "passkey probe at length 64", r"context probe: \d+ windows of L=32 \(stride 4\)",
            "context probe at length 64", re.escape(f"written: {written}")]
    logged = messages((existing_run / "eval.log").read_text())
    assert len(logged) == len(want) and all(re.fullmatch(w, m) for w, m in zip(want, logged)), logged
    assert messages(proc.stdout) == logged  # the console says the same
    assert "%|" not in proc.stderr  # no progress bar without a terminal


def test_posbench_eval_shows_a_bar_on_a_terminal_and_appends_to_eval_log(existing_run, data_cache, tmp_path):
    """On a terminal (CI unset), a tqdm bar on stderr counts the lengths to 2/2, the log lines still reach stdout, and
    ``eval.log`` keeps what it held."""
    (existing_run / "eval.log").write_text("an earlier evaluation's line\n")
    env = cli_env(POSBENCH_CACHE=str(data_cache))
    env.pop("CI", None)
    proc, terminal = on_a_terminal("eval", f"run={existing_run}", *EVAL, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + terminal
    assert re.search(r"eval rope: +100%\|.*\| 2/2 ", terminal), terminal
    assert "evaluating at length 64" in messages(proc.stdout)
    log_text = (existing_run / "eval.log").read_text()
    assert log_text.startswith("an earlier evaluation's line\n")
    assert messages(log_text)[-1] == f"written: {existing_run / 'eval-rope-nonoverlapping-validation-1.json'}"


def test_fire_evaluated_on_a_cpu_says_when_it_compiles(run_cli, data_cache, tmp_path):
    """FIRE's evaluation on a CPU, past its threshold (16, below L here) in sliding-window layers (W = 16), compiles
    FlexAttention: the line comes after "evaluating at length 32" and before the next length, on the console and in
    ``eval.log`` (skipped where Flex does not compile: the dense kernel)."""
    run = tmp_path / "fire"
    trained = run_into(run_cli, data_cache, run, "scheme=fire", "scheme.threshold=16", "model.layer_pattern=L",
                       "model.window=16")
    assert trained.returncode == 0, trained.stdout + trained.stderr
    proc = run_cli("eval", f"run={run}", *EVAL, "device=cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if NO_FLEX in proc.stdout + proc.stderr:
        pytest.skip(f"compiled FlexAttention does not run on this CPU: {proc.stdout[-300:]}")
    logged = messages((run / "eval.log").read_text())
    at = logged.index("evaluating at length 32")
    assert logged[at + 1] == "compiling the attention kernel for length 32", logged
    assert logged.index("evaluating at length 64") > at + 1
    assert "compiling the attention kernel for length 32" in messages(proc.stdout)
    assert "compiling the attention kernel for length 32" in messages((run / "train.log").read_text())  # (its eval)
