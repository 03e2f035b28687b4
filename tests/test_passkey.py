"""The passkey retrieval probe: its windows against a construction written here, a copying model and a uniform
model, the training option, the refusals, and the report's retrieval table against the formulas (Wilson interval,
exact McNemar) computed here."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from helpers import refused, run_into, snapshot, train_here, wilson
from posbench.data import needles
from posbench.data.batches import get_batch
from posbench.evaluation import passkey
from posbench.report import render

V = 50
NEEDLE = needles.Needle(marker=(40, 41, 42), end=(43,), keys=tuple(range(20, 30)), k=3)


def stream(n=5000, seed=1):
    """Haystack text: tokens 1…19 only, so the marker, the end mark and the keys never occur in it."""
    return np.random.default_rng(seed).integers(1, 20, n).astype(np.int64)


def find(seq: list[int], sub) -> list[int]:
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i: i + len(sub)] == list(sub)]


# ---- the windows -------------------------------------------------------------------------------------------


def test_windows_match_an_independent_construction():
    tokens, lengths, depths = stream(), [32, 64], [0.0, 0.3, 1.0]
    trials = passkey.trials(len(tokens), NEEDLE, lengths, depths, 4, seed=7)
    assert len(trials) == len(lengths) * len(depths) * 4
    for t in trials:
        hay_len = t.length - (3 + 3 + 1) - (3 + 3)  # T − needle − query
        rng = np.random.default_rng([7, t.length, t.index])  # the documented draws, in their order
        offset = int(rng.integers(0, len(tokens) - hay_len + 1))
        key = [20 + int(i) for i in rng.integers(0, 10, 3)]
        assert (t.offset, list(t.key)) == (offset, key)
        built = list(tokens[offset: offset + hay_len])
        at = round(t.depth * hay_len)
        built[at:at] = [40, 41, 42, *key, 43]  # the needle inserted at depth d
        built += [40, 41, 42, *key]  # the query
        win = passkey.window(tokens, NEEDLE, t).tolist()
        assert win == built and len(win) == t.length
        markers = find(win, [40, 41, 42])
        assert markers == [at, t.length - 6]  # the needle's and the query's, nowhere else
        assert t.distance == (t.length - 3) - (at + 3)  # query key start − needle key start
        control = passkey.window(tokens, NEEDLE, t, control=True).tolist()
        assert control[at + 3: at + 6] == list(t.other) != key and control[-3:] == key


def test_a_length_too_short_for_needle_and_query_is_refused():
    with pytest.raises(ValueError, match="evaluation length 12 is shorter than a needle and a query"):
        passkey.trials(1000, NEEDLE, [12], [0.5], 1, 0)


class Copier(torch.nn.Module):
    """Predicts the token after the last earlier occurrence of the context's last m tokens (an induction head)."""

    def __init__(self, m: int):
        super().__init__()
        self.m = m

    def forward(self, x, last=None):
        logits = torch.zeros(*x.shape, V)
        for b, row in enumerate(x.tolist()):
            for t in range(self.m - 1, len(row)):
                tail = row[t - self.m + 1: t + 1]
                for s in range(t - 1, self.m - 2, -1):
                    if row[s - self.m + 1: s + 1] == tail:
                        logits[b, t, row[s + 1]] = 10.0
                        break
        return logits if last is None else logits[:, -last:]


class Uniform(torch.nn.Module):
    def forward(self, x, last=None):
        return torch.zeros(x.shape[0], last or x.shape[1], V)


def test_a_copying_model_retrieves_every_key_and_the_control_shows_it():
    rows = passkey.probe(Copier(m=3), stream(), NEEDLE, [32, 48], [0.0, 0.5, 1.0], 5, seed=3, batch_tokens=256)
    assert len(rows) == 2 * 3 * 5 and all(r["correct"] for r in rows)
    assert all(r["gain"] > 5 for r in rows)  # the control's needle held another key: the copier predicts that one


def test_a_uniform_model_scores_chance():
    rows = passkey.probe(Uniform(), stream(), NEEDLE, [32], [0.0, 1.0], 10, seed=3)
    assert not any(r["correct"] for r in rows)  # (1/V)^k by chance: 8e-6 per trial
    assert all(r["logp"] == pytest.approx(-math.log(V)) and r["gain"] == pytest.approx(0, abs=1e-6) for r in rows)


# ---- training with needles -------------------------------------------------------------------------------------


def test_rate_zero_gives_todays_batches():
    tokens = stream(3000)
    x, y = get_batch(tokens, 5, 2, 4, 32, 1, NEEDLE, 0.0)
    starts = np.random.default_rng([2, 5, 1]).integers(0, len(tokens) - 33, 4)  # the batch as it always was
    crops = np.stack([tokens[s: s + 33] for s in starts])
    assert torch.equal(x, torch.from_numpy(crops[:, :-1])) and torch.equal(y, torch.from_numpy(crops[:, 1:]))


def test_rate_one_puts_a_needle_and_its_query_in_every_window():
    tokens = stream(3000)
    x, y = get_batch(tokens, 0, 0, 64, 32, 0, NEEDLE, 1.0)
    full = torch.cat([x, y[:, -1:]], 1).tolist()  # (B, L + 1)
    for row in full:
        at = find(row, [40, 41, 42])
        assert len(at) == 2 and at[1] - at[0] >= 7  # needle (7 tokens) then the query, within the window
        key = row[at[0] + 3: at[0] + 6]
        assert row[at[0] + 6] == 43 and row[at[1] + 3: at[1] + 6] == key and all(20 <= k < 30 for k in key)


def test_keys_are_frequent_whole_words_and_never_marker_tokens(data_cache):
    from posbench.data import cache

    corpus = cache.prepare("shakespeare", 4096, cache_dir=str(data_cache), validation=["hamlet", "the-tempest"],
                          test=["macbeth", "twelfth-night"])
    needle = needles.make_needle(corpus.tokenizer_path, corpus.tokens["train"], " The pass key is", ".", 4, 100, "frequent")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(corpus.tokenizer_path))
    assert tok.decode(list(needle.marker)) == " The pass key is" and tok.decode(list(needle.end)) == "."
    assert len(needle.keys) == 100 and not set(needle.keys) & set(needle.marker + needle.end)
    assert all(re.fullmatch(r" [A-Za-z]{3,}", tok.decode([k])) for k in needle.keys)
    counts = np.bincount(np.asarray(corpus.tokens["train"]), minlength=4096)
    assert min(counts[list(needle.keys)]) >= np.sort(counts)[-2000]  # frequent tokens, not rare ones


# ---- refusals ------------------------------------------------------------------------------------------------


REFUSALS = [
    (["eval.passkey.depths=[0,1.5]"], r"eval.passkey.depths=\[0(\.0)?, 1\.5\]"),
    (["eval.passkey.lengths=[16,64]"], r"evaluation length 16 is shorter than a needle and a query"),
    (["eval.passkey.key_length=0"], r"eval.passkey.key_length=0"),
    (["eval.passkey.key_vocab=3"], r"eval.passkey.key_vocab=3 is smaller than eval.passkey.key_length=4"),
    (["eval.passkey.keys=frequent", "eval.passkey.key_vocab=100000"], r"eval.passkey.key_vocab=100000: the key vocabulary"),
    (["eval.passkey.keys=reserved", "eval.passkey.key_vocab=4000"], r"eval.passkey.key_vocab=4000: the key vocabulary .* "
                                                                    r"tokens absent from the train split"),
    (["eval.passkey.marker="], r"eval.passkey.marker='': the run's tokenizer cannot encode it"),
    (["eval.probes=[needle]"], r"eval.probes has 'needle'"),
    (["data.passkey_rate=1.5"], r"data.passkey_rate=1.5"),
    (["scheme=learned", "scheme.max_positions=64", "eval.passkey.lengths=[32,128]"],
     r"scheme.max_positions=64: a learned table of 64 rows cannot serve length 128"),
]


@pytest.mark.parametrize("overrides, message", REFUSALS, ids=[" ".join(r[0]) for r in REFUSALS])
def test_bad_probe_settings_exit_2_with_nothing_written(posbench_here, data_cache, tmp_path, overrides, message):
    run = tmp_path / "run"
    run.mkdir()
    before = snapshot(run)
    line = refused(run_into(posbench_here, data_cache, run, "eval.probes=[passkey]", *overrides), run, before)
    assert re.search(message, line), line


# ---- end to end, and the report ---------------------------------------------------------------------------------


def test_a_probed_run_records_trials_beside_perplexity_and_posbench_eval_probes_again(run_cli, data_cache, tmp_path,
                                                                                       torch_state):
    """The run trained in this process; ``posbench eval`` probing it again in a real one."""
    run = tmp_path / "run"
    assert train_here(data_cache, run, "eval.probes=[passkey]", "data.passkey_rate=0.5", "eval.passkey.trials=2",
                      "eval.passkey.depths=[0,1]")["status"] == "complete"
    rec = json.loads((run / "results.json").read_text())
    assert [r["length"] for r in rec["results"]] == [32, 64]  # perplexity is still there
    assert len(rec["passkey"]["trials"]) == 2 * 2 * 2 and rec["passkey"]["settings"]["train_length"] == 32
    assert rec["config"]["data"]["passkey_rate"] == 0.5
    again = run_cli("eval", f"run={run}", "eval.probes=[passkey]", "eval.lengths=[64]", "eval.passkey.trials=3")
    assert again.returncode == 0, again.stdout + again.stderr
    evaluated = json.loads(next(run.glob("eval-*.json")).read_text())
    assert {t["length"] for t in evaluated["passkey"]["trials"]} == {64} and len(evaluated["passkey"]["trials"]) == 15


def fake_run(folder, scheme, outcomes, L=32, seed=0, split="validation", name="results.json"):
    """A results file whose probe has ``outcomes``: {(length, trial): correct} at depth 0.5; distance = length − 8."""
    folder.mkdir(parents=True, exist_ok=True)
    trials = [{"length": n, "depth": 0.5, "trial": i, "distance": n - 8, "correct": c, "logp": -1.0, "gain": 0.5}
              for (n, i), c in outcomes.items()]
    settings = {"trials": 20, "depths": [0.5], "key_length": 4, "key_vocab": 100, "marker": " The pass key is",
                "end": ".", "threshold": 0.8, "seed": 0, "split": split, "train_length": L}
    rows = [{"length": n, "ppl": 100.0, "nll": math.log(100), "nll_by_position": {"position": [0], "nll": [4.6]}}
            for n in (32, 64)]
    config = {"scheme": {"name": scheme}, "train": {"seq_len": L}, "eval": {"lengths": [32, 64], "split": split},
              "seed": seed}
    (folder / name).write_text(json.dumps({
        "format": 4, "scheme": scheme, "label": scheme, "train_length": L, "protocol": "nonoverlapping", "stride": None,
        "split": split, "seed": seed, "config": config, "results": rows,
        "passkey": {"settings": settings, "trials": trials}}))


def test_the_report_ranks_retrieval_with_wilson_intervals_mcnemar_and_the_validity_rule(tmp_path):
    n = 20
    fake_run(tmp_path / "runs" / "a", "alibi", {**{(32, i): True for i in range(n)}, **{(64, i): i < 18 for i in range(n)}})
    fake_run(tmp_path / "runs" / "b", "rope", {**{(32, i): i < 19 for i in range(n)}, **{(64, i): i < 10 for i in range(n)}})
    fake_run(tmp_path / "runs" / "c", "nope", {**{(32, i): i < 5 for i in range(n)}, **{(64, i): True for i in range(n)}})
    assert render.write_report([tmp_path / "runs"], tmp_path / "out")[1]  # what posbench report runs
    md = (tmp_path / "out" / "report.md").read_text()
    rows = {line.split(" |")[0].strip("| "): line for line in md.splitlines() if line.startswith("| alibi") or
            line.startswith("| rope") or line.startswith("| nope")}
    lo, hi = wilson(18, 20)
    assert f"90% ({lo:.0%}–{hi:.0%}) ★" in rows["alibi"]  # the best ranked row at 64
    # rope at 64: 10/20; discordant with alibi: 8 (alibi right only), 0 (rope right only): p = 2 · 0.5^8 < 0.05
    assert "50% (" in rows["rope"] and "50% (" in rows["rope"].split("|")[3] and "★" not in rows["rope"].split("|")[3]
    # nope: 25% within L (distance ≤ 32 only at length 32): not valid, so its 100% at 64 is not ranked
    assert "nope (does not retrieve within L)" in rows
    assert "100% (" in rows["nope (does not retrieve within L)"] and "★" not in rows["nope (does not retrieve within L)"]
    import csv

    cells = {(r["setting"], r["length"]): r for r in csv.DictReader(open(tmp_path / "out" / "passkey.csv"))}
    assert float(cells["rope", "64"]["p_value"]) == pytest.approx(2 * 0.5 ** 8)
    assert float(cells["rope", "32"]["p_value"]) == pytest.approx(1.0)  # 1 discordant pair: p = 1
    assert cells["rope", "32"]["star"] == "True"
    assert (tmp_path / "out" / "passkey_vs_distance.png").exists() and (tmp_path / "out" / "passkey_heatmap.png").exists()


def test_seeds_pair_by_window_and_other_probes_get_their_own_table(tmp_path):
    """Two seeds of a row are pooled per window (a sign test over windows, not over seed × window pairs); a
    re-evaluation probing the test split is its own table, never pooled with the validation probe's trials."""
    n = 20
    for seed in (0, 1):  # alibi: right on every window at 64; rope: wrong on windows 0…3 with both seeds
        fake_run(tmp_path / "runs" / f"a{seed}", "alibi",
                 {**{(32, i): True for i in range(n)}, **{(64, i): True for i in range(n)}}, seed=seed)
        fake_run(tmp_path / "runs" / f"b{seed}", "rope",
                 {**{(32, i): True for i in range(n)}, **{(64, i): i >= 4 for i in range(n)}}, seed=seed)
    fake_run(tmp_path / "runs" / "b0", "rope", {(64, i): False for i in range(n)}, split="test", name="eval-rope-test-1.json")
    assert render.write_report([tmp_path / "runs"], tmp_path / "out")[1]  # what posbench report runs
    import csv

    cells = list(csv.DictReader(open(tmp_path / "out" / "passkey.csv")))
    validation = {(c["setting"], c["length"]): c for c in cells if c["table"] == "1"}
    assert validation["rope", "64"]["n"] == "40" and validation["rope", "64"]["correct"] == "32"  # 2 seeds × 20 windows
    assert float(validation["rope", "64"]["p_value"]) == pytest.approx(2 * 0.5 ** 4)  # 4 windows differ, not 8 pairs
    test = [c for c in cells if c["table"] == "2"]
    assert [(c["setting"], c["length"], c["n"], c["correct"]) for c in test] == [("rope", "64", "20", "0")]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "### P1. validation split" in md and "### P2. test split" in md


def test_validity_counts_windows_no_longer_than_L():
    """Failures at distance ≤ L inside windows longer than L do not make a row invalid; failures at T ≤ L do."""
    from posbench.evaluation import retrieval

    def rec(setting, ok_short, ok_long):
        trials = [{"length": n, "depth": 0.5, "trial": i, "distance": 10, "correct": ok_short if n <= 32 else ok_long,
                   "logp": -1.0, "gain": 0.0} for n in (32, 128) for i in range(10)]
        settings = {"trials": 10, "depths": [0.5], "key_length": 4, "key_vocab": 100, "marker": "m", "end": ".",
                    "threshold": 0.8, "seed": 0, "split": "validation", "train_length": 32}
        return {"setting": setting, "order": (setting,), "seed": 0, "passkey": {"settings": settings, "trials": trials}}

    cells = retrieval.cells([rec("a", True, False), rec("b", False, True)])
    valid = {c["setting"]: (c["within_L"], c["valid"]) for c in cells}
    assert valid == {"a": (1.0, True), "b": (0.0, False)}
    assert not any(c["star"] for c in cells if c["length"] == 128 and c["setting"] == "b")  # b is not ranked past L
