"""``posbench eval``: re-evaluate a trained run's checkpoint beside its results, never overwriting them;
bad input fails with one line and exit status 2, writing nothing; and ``evaluate``'s accounting under
both protocols (docs/design.md §6) on a small random-init model.

The command runs in a real process where its output or the process matters (the file it names, a refusal's lone
line); other re-evaluations run the same job in this process (helpers.eval_here), and other refusals go through the
CLI's ``main`` in this process (conftest's ``posbench_here``).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import eval_here, kept_torch_state, ok, posbench, refused, snapshot, train_here
from posbench.evaluation.perplexity import evaluate, span
from posbench.model.build import build_model

EVAL = ["eval.lengths=[32,64]", "eval.max_tokens=256"]


def ppls(path: Path) -> dict:
    return {r["length"]: r["ppl"] for r in json.loads(path.read_text())["results"]}


# ---- the session's trained run ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cwd(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eval-cli-cwd")


@pytest.fixture(scope="module")
def run(trained_run) -> Path:
    """The session's finished ``posbench train debug=fast`` run (L=32, eval at [32, 64] on 256 tokens): read only."""
    assert (trained_run / "checkpoint.pt").is_file() and (trained_run / "results.json").is_file()
    return trained_run


def copy_run(run: Path, dest: Path, checkpoint: bool = True) -> Path:
    """A copy of the run's results (and checkpoint.pt): a run folder of its own for a test to change."""
    dest.mkdir(parents=True)
    shutil.copytree(run / ".hydra", dest / ".hydra")
    for name in ["results.json", "results.csv", "metrics.jsonl"] + (["checkpoint.pt"] if checkpoint else []):
        shutil.copy2(run / name, dest / name)
    return dest


# ---- re-evaluation beside the run's results -------------------------------------------------------


def test_sliding_eval_adds_numbered_results_and_touches_nothing(run, tmp_path, cwd):
    folder = copy_run(run, tmp_path / "run")
    before = snapshot(folder)
    args = ["eval", f"run={folder}", *EVAL, "eval.protocol=sliding", "eval.stride=8"]

    proc = ok(posbench(*args, cwd=cwd))
    after = snapshot(folder)
    for rel, state in before.items():
        if rel not in ("eval.log", "."):  # (the folder's own mtime moves with the files added)
            assert after.get(rel) == state, f"{rel} was changed or removed by posbench eval"
    new = set(after) - set(before) - {"eval.log"}
    assert new == {"eval-rope-sliding-validation-1.json", "eval-rope-sliding-validation-1.csv"}
    assert "eval-rope-sliding-validation-1.json" in proc.stdout

    rec = json.loads((folder / "eval-rope-sliding-validation-1.json").read_text())
    assert rec["protocol"] == "sliding" and rec["stride"] == 8
    assert rec["lengths"] == [32, 64] and rec["split"] == "validation"
    assert [r["length"] for r in rec["results"]] == [32, 64]
    assert all(r["tokens"] == 256 for r in rec["results"])
    assert rec["scheme"] == "rope" and rec["train_length"] == 32
    csv_lines = (folder / "eval-rope-sliding-validation-1.csv").read_text().splitlines()
    assert len(csv_lines) == 3 and "protocol" in csv_lines[0] and all("sliding" in line for line in csv_lines[1:])

    first = snapshot(folder)
    ok(posbench(*args, cwd=cwd))  # a second evaluation: -2, never over -1
    after = snapshot(folder)
    for rel, state in first.items():
        if rel not in ("eval.log", "."):
            assert after.get(rel) == state, f"{rel} was changed or removed by the second posbench eval"
    assert set(after) - set(first) - {"eval.log"} == {"eval-rope-sliding-validation-2.json", "eval-rope-sliding-validation-2.csv"}
    second = json.loads((folder / "eval-rope-sliding-validation-2.json").read_text())
    assert (second["protocol"], second["stride"], second["lengths"], second["split"]) == ("sliding", 8, [32, 64], "validation")
    assert ppls(folder / "eval-rope-sliding-validation-2.json") == ppls(folder / "eval-rope-sliding-validation-1.json")


def test_eval_on_the_test_split(run, tmp_path, torch_state):
    folder = copy_run(run, tmp_path / "run")
    assert eval_here(f"run={folder}", *EVAL, "eval.split=test")["results"]
    rec = json.loads((folder / "eval-rope-nonoverlapping-test-1.json").read_text())
    assert rec["split"] == "test" and rec["protocol"] == "nonoverlapping" and rec["lengths"] == [32, 64]
    assert (folder / "eval-rope-nonoverlapping-test-1.csv").is_file()
    assert not list(folder.glob("eval-*-validation-*"))
    assert ppls(folder / "eval-rope-nonoverlapping-test-1.json") != ppls(folder / "results.json")  # other tokens


@pytest.fixture(scope="module")
def reevaluated(run, tmp_path_factory) -> Path:
    """A copy of the run evaluated again in this process as it was trained (nonoverlapping), then with linear
    RoPE scaling ×4: eval-rope-nonoverlapping-validation-1.json and eval-rope_linearx4_at_eval-…-1.json beside its results."""
    folder = copy_run(run, tmp_path_factory.mktemp("reevaluated") / "run")
    with kept_torch_state():
        assert eval_here(f"run={folder}", *EVAL, "eval.protocol=nonoverlapping")["results"]
        assert eval_here(f"run={folder}", *EVAL, "scheme.scaling=linear", "scheme.factor=4")["results"]
    return folder


def test_nonoverlapping_reeval_reproduces_the_training_run(reevaluated):
    folder = reevaluated
    trained = json.loads((folder / "results.json").read_text())
    again = json.loads((folder / "eval-rope-nonoverlapping-validation-1.json").read_text())
    assert ppls(folder / "eval-rope-nonoverlapping-validation-1.json") == ppls(folder / "results.json")  # exactly
    assert [(r["tokens"], r["windows"], r["nll"]) for r in again["results"]] == \
           [(r["tokens"], r["windows"], r["nll"]) for r in trained["results"]]
    assert again["seed"] == trained["seed"] and again["train_tokens"] == trained["train_tokens"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_gpu_trained_run_can_be_evaluated_on_a_machine_without_cuda(run, tmp_path, torch_state):
    """A run's recorded train.device is history: posbench eval checks its own device (default auto), not the one
    the run was trained on, so a run trained on a GPU is re-evaluated on a laptop."""
    folder = tmp_path / "gpu-run"
    shutil.copytree(run, folder)
    state = torch.load(folder / "checkpoint.pt", weights_only=True)
    state["config"]["train"]["device"] = "cuda"
    torch.save(state, folder / "checkpoint.pt")
    assert eval_here(f"run={folder}", "eval.lengths=[32,64]", "eval.max_tokens=256")["results"]
    (record,) = folder.glob("eval-*.json")
    rec = json.loads(record.read_text())
    assert rec["config"]["train"]["device"] == "cuda" and rec["device"] == "cpu"


# ---- bad input: exit 2, one line, nothing written --------------------------------------------------


BAD = ["missing folder", "no checkpoint", "newer format", "garbage checkpoint", "stride 0", "stride 65",
       "learned table too small"]


@pytest.fixture(scope="module")
def learned_run(data_cache, tmp_path_factory) -> Path:
    """A debug=fast learned run with a 64-row table (trained in this process): read only."""
    folder = tmp_path_factory.mktemp("eval-cli-learned") / "run"
    with kept_torch_state():
        assert train_here(data_cache, folder, "scheme=learned", "scheme.max_positions=64", *EVAL)["status"] == "complete"
    assert json.loads((folder / "results.json").read_text())["config"]["scheme"]["max_positions"] == 64
    return folder


def bad_case(case: str, run: Path, learned_run: Path, root: Path) -> tuple[Path, list[str]]:
    """The run folder of a bad case, made under ``root``, and the eval overrides to give with it."""
    def newer(folder):
        state = torch.load(run / "checkpoint.pt", weights_only=True)
        torch.save({**state, "format": 99}, folder / "checkpoint.pt")

    def garbage(folder):
        (folder / "checkpoint.pt").write_bytes(b"PK\x03\x04 this is not a checkpoint" * 100)

    cases = {  # case: (prepare the folder, eval overrides)
        "missing folder": (None, EVAL),
        "no checkpoint": (lambda f: copy_run(run, f, checkpoint=False), EVAL),
        "newer format": (lambda f: (copy_run(run, f, checkpoint=False), newer(f)), EVAL),
        "garbage checkpoint": (lambda f: (copy_run(run, f, checkpoint=False), garbage(f)), EVAL),
        "stride 0": (lambda f: copy_run(run, f), [*EVAL, "eval.protocol=sliding", "eval.stride=0"]),
        "stride 65": (lambda f: copy_run(run, f), [*EVAL, "eval.protocol=sliding", "eval.stride=65"]),
        "learned table too small": (lambda f: shutil.copytree(learned_run, f), ["eval.lengths=[32,128]", "eval.max_tokens=256"]),
    }
    assert set(cases) == set(BAD)
    prepare, overrides = cases[case]
    folder = root / case.replace(" ", "-")
    if prepare:
        prepare(folder)
    return folder, overrides


@pytest.mark.parametrize("case", BAD)
def test_bad_eval_input_fails_with_one_line_and_writes_nothing(case, run, learned_run, posbench_here, tmp_path):
    folder, overrides = bad_case(case, run, learned_run, tmp_path)
    before = snapshot(folder) if folder.exists() else None
    proc = posbench_here("eval", f"run={folder}", *overrides)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert len(lines) == 1 and lines[0].startswith("posbench: error:"), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    if before is None:
        assert not folder.exists(), f"posbench eval created {folder}"
    else:
        assert snapshot(folder) == before, "posbench eval wrote into the run folder"


@pytest.mark.parametrize("case, words", [
    ("missing folder", ["no checkpoint"]),
    ("no checkpoint", ["no checkpoint"]),
    ("newer format", ["99"]),
    ("garbage checkpoint", ["not a readable"]),
    ("stride 0", ["eval.stride"]),
    ("stride 65", ["eval.stride"]),
    ("learned table too small", ["max_positions", "128"]),
])
def test_bad_eval_input_message_says_what_is_wrong(case, words, run, learned_run, posbench_here, tmp_path):
    folder, overrides = bad_case(case, run, learned_run, tmp_path)
    message = posbench_here("eval", f"run={folder}", *overrides).stderr
    assert all(w in message for w in words), message


@pytest.mark.parametrize("kind", ["unreadable-checkpoint", "unknown-scheme-option"])
def test_a_bad_eval_in_a_real_process_is_one_line_and_writes_nothing(kind, run, learned_run, cwd, tmp_path):
    """The process-level contract once per kind (a checkpoint torch cannot read, a key Hydra cannot compose):
    exit status 2, nothing on stderr but the line, no traceback, the folder untouched."""
    if kind == "unreadable-checkpoint":
        folder, overrides = bad_case("garbage checkpoint", run, learned_run, tmp_path)
    else:
        folder, overrides = copy_run(run, tmp_path / "run"), [*EVAL, "scheme.bogus_option=1"]
    before = snapshot(folder)
    message = refused(posbench("eval", f"run={folder}", *overrides, cwd=cwd), folder, before)
    assert ("not a readable" if kind == "unreadable-checkpoint" else "scheme.bogus_option") in message, message


# ---- evaluate(): protocols and accounting on a random-init model ----------------------------------


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    spec = {"vocab_size": 50, "model": {"n_layer": 2, "n_head": 2, "d_model": 16, "d_ff": 32, "dropout": 0.0},
            "scheme": {"name": "rope", "base": 10000.0}}
    model = build_model(spec).eval()
    tokens = np.random.default_rng(0).integers(0, 50, 301).astype(np.uint16)
    return model, tokens


@pytest.mark.parametrize("lengths", [[8, 16], [5, 8]])
def test_sliding_with_stride_equal_to_length_is_nonoverlapping(tiny, lengths):
    model, tokens = tiny
    for length in lengths:
        if span(len(tokens), [length], 96) % length:
            continue  # a ragged last window: nonoverlapping scores it with less context than sliding
        a = evaluate(model, tokens, [length], "nonoverlapping", max_tokens=96)[0]
        b = evaluate(model, tokens, [length], "sliding", stride=length, max_tokens=96)[0]
        assert b["ppl"] == pytest.approx(a["ppl"], rel=1e-12)
        assert (b["tokens"], b["windows"]) == (a["tokens"], a["windows"])
        assert b["nll_by_position"]["position"] == a["nll_by_position"]["position"]
        np.testing.assert_allclose(b["nll_by_position"]["nll"], a["nll_by_position"]["nll"], rtol=1e-12)


@pytest.mark.parametrize("lengths, max_tokens", [([8, 16], 96), ([5, 8], 100), ([7], 1000), ([16], 16)])
def test_every_protocol_scores_the_span_with_the_implied_windows(tiny, lengths, max_tokens):
    model, tokens = tiny
    n = span(len(tokens), lengths, max_tokens)
    rows = evaluate(model, tokens, lengths, "nonoverlapping", max_tokens=max_tokens)
    for r, length in zip(rows, lengths):
        assert (r["length"], r["tokens"], r["windows"]) == (length, n, math.ceil(n / length))
    for length in lengths:
        n = span(len(tokens), [length], max_tokens)
        for stride in sorted({s for s in (1, 3, 7) if s <= length} | {length}):
            r = evaluate(model, tokens, [length], "sliding", stride=stride, max_tokens=max_tokens)[0]
            expected = 1 + math.ceil((n - length) / stride) if n > length else 1
            assert (r["length"], r["tokens"], r["windows"]) == (length, n, expected), (length, stride)
            assert math.isfinite(r["ppl"]) and r["ppl"] == pytest.approx(math.exp(r["nll"]))


def test_sliding_stride_1_matches_a_naive_per_token_loop(tiny):
    """Stride 1: token j is predicted from the L_eval tokens before it (fewer at the start of the stream)."""
    model, tokens = tiny
    length, n = 8, span(len(tokens), [8], 64)
    stream = torch.from_numpy(tokens[: n + 1].astype(np.int64))
    nll = 0.0
    with torch.no_grad():
        for j in range(1, length):  # the first targets: all the context there is
            nll += F.cross_entropy(model(stream[None, :j])[0, -1:], stream[j: j + 1]).item()
        ctx = torch.stack([stream[j - length: j] for j in range(length, n + 1)])  # (n - L + 1, L)
        nll += F.cross_entropy(model(ctx)[:, -1], stream[length: n + 1], reduction="sum").item()
    r = evaluate(model, tokens, [length], "sliding", stride=1, max_tokens=64)[0]
    assert r["tokens"] == n and r["windows"] == 1 + n - length
    assert r["nll"] == pytest.approx(nll / n, rel=1e-5)
    assert r["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-5)


# ---- re-evaluation with a scheme option changed (RoPE scaling) ------------------------------------


class NaiveInterpolatedRoPE(torch.nn.Module):
    """RoPE at positions p/s, written here from RoFormer's rotation (pairs (i, i + Dh/2), θ_i = base^(−2i/Dh)):
    Position Interpolation (Chen et al. 2023) with no code of posbench's schemes."""

    has_bias = key_only_bias = contextual = weight_decay = False

    def __init__(self, head_dim: int, factor: float, base: float = 10000.0):
        super().__init__()
        self.head_dim, self.factor, self.base = head_dim, factor, base

    def embed(self, x, pos):
        return x

    def rotation(self, pos, dtype):
        half = self.head_dim // 2
        angles = torch.tensor([[(p / self.factor) * self.base ** (-2 * i / self.head_dim) for i in range(half)]
                               for p in pos.tolist()], dtype=torch.float64)  # (T, Dh/2)
        return angles.cos(), angles.sin()

    def rotate(self, q, k, rotation):
        cos, sin = (t.to(q.dtype) for t in rotation)

        def turn(x):
            x1, x2 = x[..., : self.head_dim // 2], x[..., self.head_dim // 2:]
            return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

        return turn(q), turn(k)

    def score_mod(self, score, h, q_pos, k_pos):
        return score


def test_eval_with_linear_scaling_equals_positions_divided_by_the_factor(reevaluated):
    from posbench.data import cache
    from posbench.model.gpt import GPT

    folder = reevaluated
    plain = json.loads((folder / "eval-rope-nonoverlapping-validation-1.json").read_text())
    scaled = json.loads((folder / "eval-rope_linearx4_at_eval-nonoverlapping-validation-1.json").read_text())
    assert "scheme_overrides" not in plain and plain["config"]["scheme"]["scaling"] == "none"
    assert scaled["scheme"] == "rope" and scaled["label"] == "rope (linear×4 at eval)" and plain["label"] == "rope"
    assert scaled["scheme_overrides"] == {"scaling": "linear", "factor": 4.0, "original_length": 32}
    assert scaled["config"]["scheme"] == {"name": "rope", "base": 10000.0, "scaling": "linear", "factor": 4.0,
                                          "beta_fast": 32.0, "beta_slow": 1.0, "original_length": 32,
                                          "yarn_ramp": "reference", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "rotary_fraction": 1.0}
    assert ppls(folder / "eval-rope-nonoverlapping-validation-1.json") == ppls(folder / "results.json")
    assert all(a != b for a, b in zip(ppls(folder / "eval-rope_linearx4_at_eval-nonoverlapping-validation-1.json").values(),
                                      ppls(folder / "results.json").values()))

    state = torch.load(folder / "checkpoint.pt", weights_only=True)
    m = state["spec"]["model"]
    naive = GPT(state["vocab_size"], m["n_layer"], m["n_head"], m["d_model"], m["d_ff"],
                NaiveInterpolatedRoPE(m["d_model"] // m["n_head"], 4.0), dropout=m["dropout"],
                scale_embeddings=m["scale_embeddings"])
    naive.load_state_dict(state["model"])
    tokens = cache.prepare(**scaled["config"]["data"]).tokens["validation"]
    rows = evaluate(naive.eval(), tokens, [32, 64], max_tokens=256)
    for row, want in zip(rows, scaled["results"]):
        assert (row["length"], row["tokens"]) == (want["length"], want["tokens"])
        assert row["nll"] == pytest.approx(want["nll"], rel=1e-5)


@pytest.mark.parametrize("overrides, words", [
    (["scheme.max_positions=64"], ["scheme.max_positions=64", "rope scheme", "scaling"]),
    (["scheme.scaling=bogus"], ["scheme.scaling='bogus'", "yarn"]),
    (["scheme.scaling=yarn", "scheme.factor=abc"], ["scheme.factor", "abc"]),
    (["scheme.scaling=ntk", "scheme.factor=0.5"], ["scheme.factor=0.5", ">= 1"]),
    (["scheme.factor=4"], ["scheme.factor=4.0", "scaling=none"]),
    (["scheme.bogus_option=1"], ["scheme.bogus_option", "run's scheme"]),
    (["scheme.name=alibi"], ["scheme.name", "cannot change"]),
])
def test_a_bad_scheme_option_at_eval_fails_with_one_line_and_writes_nothing(run, tmp_path, posbench_here, overrides, words):
    folder = copy_run(run, tmp_path / "run")
    before = snapshot(folder)
    proc = posbench_here("eval", f"run={folder}", *EVAL, *overrides)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert len(lines) == 1 and lines[0].startswith("posbench: error:") and "Traceback" not in proc.stdout, proc.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert snapshot(folder) == before, "posbench eval wrote into the run folder"


def test_a_scheme_option_the_weights_do_not_fit_is_refused(learned_run, tmp_path, posbench_here):
    folder = tmp_path / "learned"  # a learned run with a 64-row table
    shutil.copytree(learned_run, folder)
    before = snapshot(folder)
    proc = posbench_here("eval", f"run={folder}", "eval.lengths=[32,128]", "eval.max_tokens=256", "scheme.max_positions=128")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "scheme.max_positions=128" in proc.stderr and "do not fit" in proc.stderr, proc.stderr
    assert snapshot(folder) == before
