"""The passkey probe's transfer control and the key halves: the transfer trials against a construction written here,
a model that copies only the keys it was built to read against one that copies any token, the transfer rule against
Wilson intervals computed here, the seeded split of the tokens against its rule, a run trained on one half and probed
on the other end to end, and the refusals."""

from __future__ import annotations

import csv
import json
import re

import numpy as np
import pytest
import torch

from helpers import eval_here, refused, run_into, snapshot, train_here, wilson
from posbench.data import needles
from posbench.data.batches import get_batch
from posbench.evaluation import passkey, retrieval
from posbench.report import render

V = 50
TRAINED = needles.Needle(marker=(40, 41, 42), end=(43,), keys=tuple(range(20, 30)), k=3)  # the keys a model learnt
UNSEEN = needles.Needle(marker=(40, 41, 42), end=(43,), keys=tuple(range(30, 40)), k=3)  # a kind it never saw as keys
LONGER = needles.Needle(marker=(40, 41, 42, 44), end=(43,), keys=tuple(range(30, 40)), k=3)  # a needle 1 token longer


def stream(n=5000, seed=1):
    """Haystack text: tokens 1…19 only, so no marker, end mark or key of either kind occurs in it."""
    return np.random.default_rng(seed).integers(1, 20, n).astype(np.int64)


class Copier(torch.nn.Module):
    """An induction head written out: after the marker's last token, predicts the token that followed the marker's
    earlier occurrence, and after a copied token the next one, but only where that token is in ``readable`` (None:
    any token). A digit reader is ``Copier(range(20, 30))``: it finds the key only when the key is of its kind."""

    def __init__(self, readable=None):
        super().__init__()
        self.readable = None if readable is None else set(readable)

    def forward(self, x, last=None):
        logits = torch.zeros(*x.shape, V)
        for b, row in enumerate(x.tolist()):
            for t in range(2, len(row)):
                for s in range(t - 1, 1, -1):  # the latest earlier place whose last 3 tokens are this place's
                    if row[s - 2: s + 1] == row[t - 2: t + 1]:
                        nxt = row[s + 1]
                        if self.readable is None or nxt in self.readable:
                            logits[b, t, nxt] = 10.0
                        break
        return logits if last is None else logits[:, -last:]


# ---- the transfer trials ----------------------------------------------------------------------------------------


def test_transfer_trials_keep_each_window_and_draw_their_own_keys():
    tokens, lengths, depths = stream(), [32, 64], [0.0, 0.5, 1.0]
    main = passkey.trials(len(tokens), TRAINED, lengths, depths, 4, seed=7)
    moved = passkey.transferred(main, LONGER, len(tokens), seed=7)
    assert len(moved) == len(main)
    for t, u in zip(main, moved):
        assert (u.length, u.depth, u.index, u.offset) == (t.length, t.depth, t.index, t.offset)
        rng = np.random.default_rng([7, t.length, t.index, 1])  # the documented draws
        key = [30 + int(i) for i in rng.integers(0, 10, 3)]
        assert list(u.key) == key and all(30 <= k < 40 for k in u.other) and u.other != u.key
        hay = t.length - (4 + 3 + 1) - (4 + 3)  # its own haystack: the longer needle takes one token more, twice
        assert u.position == round(t.depth * hay)
        win = passkey.window(tokens, LONGER, u).tolist()
        built = list(tokens[t.offset: t.offset + hay])
        built[u.position:u.position] = [40, 41, 42, 44, *key, 43]
        assert win == built + [40, 41, 42, 44, *key] and len(win) == t.length
        assert u.distance == (t.length - 3) - (u.position + 4)


def test_a_window_at_the_split_end_moves_back_for_a_shorter_needle():
    """A shorter needle leaves a longer haystack (27 tokens here, 23 for the probe's 5-token marker): at the probe's
    last offset it would run past the split, so it starts as late as it can instead."""
    tokens = stream(100)
    probe_needle = needles.Needle((40, 41, 42, 44, 45), (43,), tuple(range(30, 40)), 3)
    main = passkey.trials(len(tokens), probe_needle, [40], [0.5], 50, seed=0)
    last = max(main, key=lambda t: t.offset)
    (u,) = passkey.transferred([last], TRAINED, len(tokens), seed=0)
    assert last.offset + 23 > 100 - 27 and u.offset == min(last.offset, 100 - 27)
    assert len(passkey.window(tokens, TRAINED, u)) == 40


def test_the_transfer_control_tells_a_key_reader_from_a_copier():
    tokens = stream()
    reader = passkey.probe(Copier(range(20, 30)), tokens, TRAINED, [32, 48], [0.0, 1.0], 6, 3, transfer=UNSEEN)
    copier = passkey.probe(Copier(), tokens, TRAINED, [32, 48], [0.0, 1.0], 6, 3, transfer=UNSEEN)
    assert all(r["correct"] and not r["transfer_correct"] for r in reader)  # reads its own keys only
    assert all(r["gain"] > 5 and abs(r["transfer_gain"]) < 1e-6 for r in reader)
    assert all(r["correct"] and r["transfer_correct"] and r["transfer_gain"] > 3 for r in copier)  # (a control key may
    # share a token with the key: the copier then gets one of three right in the control too)
    plain = passkey.probe(Copier(range(20, 30)), tokens, TRAINED, [32, 48], [0.0, 1.0], 6, 3)
    assert [{k: v for k, v in r.items() if not k.startswith("transfer_")} for r in reader] == plain  # unchanged
    assert passkey.accuracy(reader, "transfer_") == {32: 0.0, 48: 0.0} and passkey.accuracy(plain, "transfer_") == {}


# ---- the rule ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k, j, n", [(20, 0, 20), (20, 9, 20), (20, 10, 20), (10, 4, 20), (6, 0, 20), (3, 0, 20),
                                     (40, 15, 40), (0, 0, 20)])
def test_reads_only_is_below_half_with_disjoint_wilson_intervals(k, j, n):
    low, _ = wilson(k, n)
    _, high = wilson(j, n)
    assert retrieval.reads_only(k, j, n) == (j / n < k / n / 2 and high < low)


def fake_record(setting, within, transfer, n=20, L=32):
    """A probe record: ``within`` and ``transfer`` keys found of n trials at length L, none at 2L."""
    trials = [{"length": length, "depth": 0.5, "trial": i, "distance": length - 8,
               "correct": length == L and i < within, "logp": -1.0, "gain": 0.5,
               "transfer_correct": length == L and i < transfer, "transfer_logp": -2.0, "transfer_gain": 0.1}
              for length in (L, 2 * L) for i in range(n)]
    settings = {"trials": n, "depths": [0.5], "key_length": 4, "key_vocab": 10, "keys": "digits", "marker": "m",
                "end": ".", "threshold": 0.8, "seed": 0, "split": "validation", "train_length": L,
                "transfer": "frequent", "transfer_key_vocab": 100, "trained_keys": "digits"}
    return {"setting": setting, "order": (setting,), "seed": 0, "passkey": {"settings": settings, "trials": trials}}


def test_cells_carry_the_transfer_columns_and_mark_a_key_reader():
    cells = {(c["setting"], c["length"]): c for c in retrieval.cells(
        [fake_record("reader", 20, 2), fake_record("copier", 19, 17), fake_record("old", 20, 0)])}
    reader = cells["reader", 32]
    low, high = wilson(2, 20)
    assert (reader["transfer_correct"], reader["transfer_accuracy"]) == (2, 0.1)
    assert (reader["transfer_ci_low"], reader["transfer_ci_high"]) == pytest.approx((low, high))
    assert reader["reads_only"] and reader["reads_only_within_L"] and reader["within_L_transfer"] == 0.1
    assert not cells["copier", 32]["reads_only_within_L"]
    assert retrieval.transfer_note(fake_record("r", 20, 2)["passkey"]["settings"], reader) == "reads trained keys only"
    untrained = {**fake_record("r", 20, 2)["passkey"]["settings"], "trained_keys": None}
    assert retrieval.transfer_note(untrained, reader) == "reads digits only"


def test_a_record_without_a_transfer_control_has_empty_columns(tmp_path):
    rec = fake_record("rope", 20, 0)
    for t in rec["passkey"]["trials"]:
        for key in ("transfer_correct", "transfer_logp", "transfer_gain"):
            del t[key]
    (cell,) = [c for c in retrieval.cells([rec]) if c["length"] == 32]
    assert cell["transfer_accuracy"] is None and cell["reads_only_within_L"] is None


def test_the_report_prints_the_transfer_columns_and_the_mark(tmp_path):
    for name, (within, transfer) in {"alibi": (20, 1), "rope": (20, 18)}.items():
        folder = tmp_path / "runs" / name
        folder.mkdir(parents=True)
        rec = fake_record(name, within, transfer)
        config = {"scheme": {"name": name}, "train": {"seq_len": 32}, "eval": {"lengths": [32, 64]}, "seed": 0}
        rows = [{"length": n, "ppl": 100.0, "nll": 4.6, "nll_by_position": {"position": [0], "nll": [4.6]}}
                for n in (32, 64)]
        (folder / "results.json").write_text(json.dumps({
            "format": 4, "scheme": name, "label": name, "train_length": 32, "protocol": "nonoverlapping",
            "stride": None, "split": "validation", "seed": 0, "config": config, "results": rows,
            "passkey": rec["passkey"]}))
    assert render.write_report([tmp_path / "runs"], tmp_path / "out")[1]
    md = (tmp_path / "out" / "report.md").read_text()
    probe = md[md.index("### P1."):].splitlines()
    line = next(row for row in probe if row.startswith("| alibi"))
    low, high = wilson(1, 20)
    assert "alibi (reads trained keys only)" in line and f"5% ({low:.0%}–{high:.0%})" in line
    assert "(reads" not in next(row for row in probe if row.startswith("| rope"))
    assert "| 32 frequent | 64 frequent | within L frequent |" in md
    cells = {(r["label"], r["length"]): r for r in csv.DictReader(open(tmp_path / "out" / "passkey.csv"))}
    assert cells["alibi", "32"]["reads_only_within_L"] == "True" and cells["rope", "32"]["transfer_correct"] == "18"


# ---- the key halves ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(data_cache):
    from posbench.data import cache

    return cache.prepare("shakespeare", 4096, cache_dir=str(data_cache), validation=["hamlet", "the-tempest"],
                         test=["macbeth", "twelfth-night"])


def test_the_halves_split_every_trained_token_but_specials_and_the_marker(corpus):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(corpus.tokenizer_path))
    half = needles.make_needle(corpus.tokenizer_path, corpus.tokens["train"], " The pass key is", ".", 4, None, "half")
    held = needles.make_needle(corpus.tokenizer_path, corpus.tokens["train"], " The pass key is", ".", 4, None, "heldout")
    a, b = set(half.keys), set(held.keys)
    counts = np.bincount(np.asarray(corpus.tokens["train"]), minlength=tok.get_vocab_size())
    special = {i for i in range(tok.get_vocab_size()) if tok.id_to_token(i).startswith("<|")}
    marker = set(tok.encode(" The pass key is").ids) | set(tok.encode(".").ids)
    eligible = {i for i in range(len(counts)) if counts[i] > 0} - special - marker
    assert special and marker and not a & b and a | b == eligible  # every eligible token in exactly one half
    assert len(half.keys) == (len(eligible) + 1) // 2 and len(held.keys) == len(eligible) // 2
    assert half.marker == tuple(tok.encode(" The pass key is").ids)  # (no space token: keys are any tokens)
    # a uniform split: the 500 most frequent tokens fall about half in each (binomial sd ≈ 11)
    top = set(np.argsort(-counts, kind="stable")[:500].tolist()) & eligible
    assert abs(len(top & a) - len(top) / 2) < 4 * (len(top) / 4) ** 0.5
    again = needles.make_needle(corpus.tokenizer_path, corpus.tokens["train"], " The pass key is", ".", 4, None, "half")
    assert again.keys == half.keys and needles.key_digest(again) != needles.key_digest(held)
    first = needles.make_needle(corpus.tokenizer_path, corpus.tokens["train"], " The pass key is", ".", 4, 50, "half")
    assert first.keys == half.keys[:50]


def test_training_needles_draw_only_from_the_half(corpus):
    half = needles.make_needle(corpus.tokenizer_path, corpus.tokens["train"], " The pass key is", ".", 4, None, "half")
    x, y = get_batch(corpus.tokens["train"], 0, 0, 64, 64, 0, half, 1.0)
    full = torch.cat([x, y[:, -1:]], 1).tolist()
    m = len(half.marker)
    keys = [row[i + m: i + m + 4] for row in full for i in range(len(row) - m) if tuple(row[i: i + m]) == half.marker]
    assert len(keys) >= 64 and all(set(k) <= set(half.keys) for k in keys if len(k) == 4)


@pytest.mark.parametrize("probe, trained, kind", [("digits", "digits", "frequent"), ("digits", None, "frequent"),
                                                  ("frequent", "frequent", "digits"), ("half", "half", "heldout"),
                                                  ("digits", "half", "heldout"), ("heldout", "half", "digits"),
                                                  ("digits", "frequent", "reserved"), ("reserved", None, "digits")])
def test_the_transfer_kind_is_one_neither_trained_nor_probed(probe, trained, kind):
    assert needles.transfer_kind(probe, trained) == kind


# ---- end to end -------------------------------------------------------------------------------------------------


def test_a_run_trained_on_one_half_is_probed_on_the_other(data_cache, tmp_path, torch_state):
    run = tmp_path / "run"
    rec = train_here(data_cache, run, "eval.probes=[passkey]", "eval.passkey.keys=half", "data.passkey_rate=0.5",
                     "eval.passkey.trials=2", "eval.passkey.depths=[0,1]")
    s = rec["passkey"]["settings"]
    assert (s["keys"], s["trained_keys"], s["transfer"]) == ("half", "half", "heldout")
    assert s["key_vocab"] > 1000 and s["transfer_key_vocab"] in (s["key_vocab"], s["key_vocab"] - 1)
    assert s["key_digest"] != s["transfer_key_digest"]
    assert all({"transfer_correct", "transfer_logp", "transfer_gain"} <= set(t) for t in rec["passkey"]["trials"])
    again = eval_here(f"run={run}", "eval.probes=[passkey]", "eval.lengths=[64]", "eval.passkey.keys=heldout",
                      "eval.passkey.trials=2")
    assert (again["passkey"]["settings"]["keys"], again["passkey"]["settings"]["transfer"]) == ("heldout", "digits")
    assert again["passkey"]["settings"]["key_digest"] == s["transfer_key_digest"]  # the same held-out half


REFUSALS = [
    (["data.passkey_rate=0.5", "eval.passkey.keys=heldout"], r"train on eval.passkey.keys=half"),
    (["eval.passkey.keys=heldout"], r"eval.passkey.keys=heldout probes the half .* this run trains no needles"),
    (["data.passkey_rate=0.5", "eval.passkey.transfer=heldout"], r"eval.passkey.transfer=heldout .* keys were digits"),
    (["eval.passkey.transfer=digits"], r"eval.passkey.transfer='digits' is not allowed: choose a key kind other than"),
    (["eval.passkey.transfer=words"], r"eval.passkey.transfer='words' is not allowed"),
]


@pytest.mark.parametrize("overrides, message", REFUSALS, ids=[" ".join(r[0]) for r in REFUSALS])
def test_a_heldout_probe_needs_a_run_that_left_a_half_out(posbench_here, data_cache, tmp_path, overrides, message):
    run = tmp_path / "run"
    run.mkdir()
    before = snapshot(run)
    line = refused(run_into(posbench_here, data_cache, run, "eval.probes=[passkey]", *overrides), run, before)
    assert re.search(message, line), line


def test_posbench_eval_refuses_a_heldout_probe_of_a_run_without_halves(posbench_here, existing_run):
    before = snapshot(existing_run)
    line = refused(posbench_here("eval", f"run={existing_run}", "eval.probes=[passkey]", "eval.passkey.keys=heldout"),
                   existing_run, before)
    assert "this run trained no needles" in line, line
