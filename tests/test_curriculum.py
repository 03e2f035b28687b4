"""The retrieval curriculum: key vocabularies (eval.passkey.keys), several needle + query pairs per window
(data.passkey_pairs), copy windows (data.copy_rate, data.copy_until), and the probe during training
(eval.probe_every). Each is checked against a construction or a formula written here."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from helpers import refused, run_into, snapshot, train_here
from posbench.cli import register
from posbench.config.checks import ConfigError
from posbench.config.schema import finalize
from posbench.data import batches, needles
from posbench.data.batches import copy_rate, get_batch

NEEDLE = needles.Needle(marker=(40, 41, 42), end=(43,), keys=tuple(range(20, 30)), k=3)  # 7-token needle, 6-token query


def stream(n=5000, seed=1):
    """Haystack text: tokens 1…19 only, so the marker, the end mark and the keys never occur in it."""
    return np.random.default_rng(seed).integers(1, 20, n).astype(np.int64)


def find(seq: list[int], sub) -> list[int]:
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i: i + len(sub)] == list(sub)]


# ---- several pairs per window ----------------------------------------------------------------------------------


@pytest.mark.parametrize("pairs, width", [(2, 40), (3, 129), (5, 65)])
def test_pairs_follow_one_another_so_each_query_answers_the_needle_just_before_it(pairs, width):
    rng = np.random.default_rng(0)
    crops = np.tile(stream(width)[None], (200, 1))
    batches.insert(crops, NEEDLE, 1.0, rng, pairs)
    for row in crops.tolist():
        at = find(row, [40, 41, 42])
        assert len(at) == 2 * pairs  # needle, query, needle, query, …
        for i in range(pairs):
            a, b = at[2 * i], at[2 * i + 1]
            key = row[a + 3: a + 6]
            assert row[a + 6] == 43 and row[b + 3: b + 6] == key and all(20 <= k < 30 for k in key)  # needle, then its query
            assert b - a >= 7 and b + 6 <= width
            if i + 1 < pairs:
                assert at[2 * i + 2] >= b + 6  # the next needle starts after this query
        assert row.count(43) == pairs  # one end mark per needle, none in a query


def test_one_pair_keeps_todays_draws():
    """data.passkey_pairs=1 is the old insertion, draw for draw (the construction below is the old code's order)."""
    tokens, width = stream(), 33
    crops = np.tile(tokens[:width][None], (16, 1))
    got = batches.insert(crops.copy(), NEEDLE, 0.5, np.random.default_rng(3), 1)
    rng, want = np.random.default_rng(3), crops.copy()
    for row in np.flatnonzero(rng.random(16) < 0.5):
        key = np.arange(20, 30)[rng.integers(0, 10, 3)]
        b = int(rng.integers(7, width - 6 + 1))
        a = int(rng.integers(0, b - 7 + 1))
        want[row, a: a + 7] = [40, 41, 42, *key, 43]
        want[row, b: b + 6] = [40, 41, 42, *key]
    assert np.array_equal(got, want)


def test_layout_of_one_pair_draws_log_uniform_distances():
    """layout()'s distance d (a pair drawing from the whole room; insert() keeps the older uniform draw for one pair),
    key to key, is floor(exp(U(ln n, ln(n + room + 1)))): P(d ≤ x) = ln((x+1)/n) / ln((n+room+1)/n)."""
    n, q, width = 7, 6, 520
    room = width - n - q
    rng = np.random.default_rng(1)
    d = np.array([b - a for _ in range(20000) for a, b in batches.layout(width, NEEDLE, 1, rng)])
    assert d.min() >= n and d.max() <= n + room
    for x in (10, 20, 60, 200, 400):
        cdf = math.log((x + 1) / n) / math.log((n + room + 1) / n)
        assert abs((d <= x).mean() - cdf) < 0.015, (x, (d <= x).mean(), cdf)


def test_many_pairs_still_reach_long_distances():
    rng = np.random.default_rng(2)
    d = [b - a for _ in range(3000) for a, b in batches.layout(129, NEEDLE, 4, rng)]
    assert min(d) == 7 and max(d) >= 129 - 4 * 13 + 7 - 5  # the longest pair takes nearly all the free room
    assert len(set(d)) > 40  # many distinct distances, not a few


def test_pairs_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="3 needle \\+ query pairs need 39 tokens, more than a window of 38"):
        batches.layout(38, NEEDLE, 3, np.random.default_rng(0))


# ---- copy windows --------------------------------------------------------------------------------------------------


def test_copy_windows_repeat_a_random_span_after_the_separator():
    tokens, width, vocab = stream(), 65, 50
    starts = np.random.default_rng(0).integers(0, 4000, 300)
    crops = np.stack([tokens[s: s + width] for s in starts])
    original = crops.copy()
    chosen = batches.copy_spans(crops, 7, vocab, 0.5, np.random.default_rng(9))
    assert 100 < chosen.sum() < 200 and np.array_equal(crops[~chosen], original[~chosen])
    spans = []
    for row, text in zip(crops[chosen], original[chosen]):
        m = next(m for m in range(1, (width - 1) // 2 + 1) if row[m] == 7 and np.array_equal(row[:m], row[m + 1: 2 * m + 1]))
        assert 7 not in row[:m].tolist()  # the separator never inside the span, so m is where it first occurs
        assert np.array_equal(row[2 * m + 1:], text[: width - 2 * m - 1])  # then the window's own text
        spans += row[:m].tolist()
    counts = np.bincount(spans, minlength=vocab)
    assert counts[7] == 0 and (counts[np.arange(vocab) != 7] > 0).all()  # uniform over every id but the separator
    assert counts.max() < 3 * counts[np.arange(vocab) != 7].mean()


def test_copy_span_lengths_cover_one_to_half_the_window():
    crops = np.ones((4000, 65), dtype=np.int64)
    batches.copy_spans(crops, 0, 50, 1.0, np.random.default_rng(4))
    m = np.argmax(crops == 0, axis=1)  # the separator's position = the span's length
    assert m.min() == 1 and m.max() == 32 and len(set(m.tolist())) == 32


def test_a_batch_with_copies_and_needles_is_the_two_generators_draws():
    """get_batch's crops, then copy windows from default_rng([seed, step, rank, 3]), then needles in the other rows from
    default_rng([seed, step, rank, 1]): the batch written out here draw by draw."""
    tokens, seed, step, rank, B, L, vocab = stream(3000), 3, 7, 1, 12, 40, 20
    x, y = get_batch(tokens, step, seed, B, L, rank, NEEDLE, 0.7, 2, 0.4, 0, vocab)
    starts = np.random.default_rng([seed, step, rank]).integers(0, len(tokens) - L - 1, B)
    want = np.stack([tokens[s: s + L + 1] for s in starts]).astype(np.int64)
    rng = np.random.default_rng([seed, step, rank, 3])
    copied = rng.random(B) < 0.4
    for row in np.flatnonzero(copied):
        m = int(rng.integers(1, L // 2 + 1))
        span = rng.integers(0, vocab - 1, m) + 1  # every id but the separator 0
        want[row] = np.concatenate([span, [0], span, want[row]])[: L + 1]
    rng = np.random.default_rng([seed, step, rank, 1])
    for row in np.flatnonzero(rng.random(B) < 0.7):
        if copied[row]:
            continue
        for a, b in batches.layout(L + 1, NEEDLE, 2, rng):
            key = np.arange(20, 30)[rng.integers(0, 10, 3)]
            want[row, a: a + 7] = [40, 41, 42, *key, 43]
            want[row, b: b + 6] = [40, 41, 42, *key]
    assert torch.equal(x, torch.from_numpy(want[:, :-1])) and torch.equal(y, torch.from_numpy(want[:, 1:]))
    assert copied.any() and (~copied).any()


def test_copy_rate_falls_linearly_to_zero_at_copy_until():
    assert copy_rate(0.5, 0.5, 0, 1000) == 0.5
    assert copy_rate(0.5, 0.5, 250, 1000) == pytest.approx(0.25)
    assert copy_rate(0.5, 0.5, 500, 1000) == 0.0 and copy_rate(0.5, 0.5, 900, 1000) == 0.0
    assert copy_rate(0.0, 0.5, 0, 1000) == 0.0


def test_defaults_give_todays_batches_and_copy_rows_get_no_needle():
    tokens = stream(3000)
    x, y = get_batch(tokens, 5, 2, 4, 32, 1, NEEDLE, 0.0, 1, 0.0, 0, 50)
    starts = np.random.default_rng([2, 5, 1]).integers(0, len(tokens) - 33, 4)  # the batch as it always was
    crops = np.stack([tokens[s: s + 33] for s in starts])
    assert torch.equal(x, torch.from_numpy(crops[:, :-1])) and torch.equal(y, torch.from_numpy(crops[:, 1:]))
    x, y = get_batch(tokens, 0, 0, 64, 32, 0, NEEDLE, 1.0, 1, 0.5, 0, 20)  # random spans of ids 1…19: no marker
    rows = torch.cat([x, y[:, -1:]], 1).tolist()
    copies = [r for r in rows if 0 in r]
    assert 10 < len(copies) < 54 and all(40 not in r for r in copies) and all(40 in r for r in rows if 0 not in r)


# ---- key vocabularies ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(data_cache):
    from posbench.data import cache

    return cache.prepare("shakespeare", 4096, cache_dir=str(data_cache), validation=["hamlet", "the-tempest"],
                        test=["macbeth", "twelfth-night"])


def test_digit_keys_read_as_the_original_test(corpus):
    tok = Tokenizer.from_file(str(corpus.tokenizer_path))
    needle = needles.make_needle(corpus.tokenizer_path, corpus.tokens["train"], " The pass key is", ".", 4, 10, "digits")
    assert [tok.decode([k]) for k in needle.keys] == [str(d) for d in range(10)]
    key = [needle.keys[d] for d in (7, 1, 4, 3)]
    assert tok.decode([*needle.marker, *key, *needle.end]) == " The pass key is 7143."
    val = np.asarray(corpus.tokens["validation"])
    assert needles.key_fraction(val, needle) == np.isin(val, needle.keys).sum() / len(val) < 1e-4
    frequent = needles.make_needle(corpus.tokenizer_path, corpus.tokens["train"], " The pass key is", ".", 4, 100, "frequent")
    assert needles.key_fraction(val, frequent) > 0.1  # the haystack is full of frequent words


def test_reserved_keys_never_occur_in_the_train_split(corpus):
    train = np.asarray(corpus.tokens["train"])
    needle = needles.make_needle(corpus.tokenizer_path, train, " The pass key is", ".", 4, 50, "reserved")
    assert len(set(needle.keys)) == 50 and not np.isin(train, needle.keys).any()


def test_a_tokenizer_that_merges_digits_cannot_spell_a_digit_key(tmp_path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["The pass key is 12 34 56 78 90 1234 5678 9012 ."] * 200,
                            trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tok.json"))
    with pytest.raises(ValueError, match="eval.passkey.keys=digits: the run's tokenizer does not spell each digit"):
        needles.make_needle(tmp_path / "tok.json", np.zeros(10, np.int64), " The pass key is", ".", 4, 10, "digits")
    years = Tokenizer(models.BPE())  # merges that leave 0…9 in order alone but spell " 1999" as one token
    years.pre_tokenizer, years.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    years.train_from_iterator(["The pass key is 1999 and 1999 ."] * 200,
                              trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    years.save(str(tmp_path / "years.json"))
    assert len(years.encode(" 1999").ids) == 1
    with pytest.raises(ValueError, match="does not spell each digit"):
        needles.make_needle(tmp_path / "years.json", np.zeros(10, np.int64), " The pass key is", ".", 4, 10, "digits")


# ---- the options' checks ----------------------------------------------------------------------------------------


@pytest.fixture
def cfg_of():
    register()

    def make(*overrides):
        with initialize_config_module("posbench.conf", version_base="1.3"):
            return finalize(compose("train", overrides=["debug=fast", *overrides]))

    return make


@pytest.mark.parametrize("overrides, message", [
    (["eval.passkey.keys=words"], r"eval.passkey.keys='words' is unknown; choose one of: digits, frequent, reserved"),
    (["eval.passkey.key_vocab=11"], r"eval.passkey.key_vocab=11 is not allowed with eval.passkey.keys=digits"),
    (["data.passkey_pairs=0"], r"data.passkey_pairs=0 is not allowed: it must be a positive integer"),
    (["data.copy_rate=1.5"], r"data.copy_rate=1.5 is not allowed: it is a fraction of training windows"),
    (["data.copy_until=0"], r"data.copy_until=0(\.0)? is not allowed"),
    (["eval.probe_every=-1"], r"eval.probe_every=-1 is not allowed"),
    (["eval.probe_every=2"], r"eval.probe_every=2 probes retrieval during training: add 'eval.probes=\[passkey\]'"),
])
def test_bad_values_are_refused_in_one_line(cfg_of, overrides, message):
    with pytest.raises(ConfigError, match=message):
        cfg_of(*overrides)


def test_filled_key_vocabulary_follows_the_key_kind(cfg_of):
    assert cfg_of().eval.passkey.key_vocab == 10
    probe = "eval.probes=[passkey]"  # (a probe's options without it are refused)
    assert cfg_of(probe, "eval.passkey.keys=frequent").eval.passkey.key_vocab == 100
    assert cfg_of(probe, "eval.passkey.keys=reserved", "eval.passkey.key_vocab=30").eval.passkey.key_vocab == 30


@pytest.mark.parametrize("overrides, message", [
    (["data.passkey_rate=0.5", "data.passkey_pairs=2"], r"data.passkey_pairs=2 needle \+ query pairs take 2 × 21 tokens, "
                                                        r"more than a training window of train.seq_len \+ 1 = 33"),
])
def test_refusals_that_need_the_tokenizer_exit_2_with_nothing_written(posbench_here, data_cache, tmp_path, overrides, message):
    run = tmp_path / "run"
    run.mkdir()
    before = snapshot(run)
    line = refused(run_into(posbench_here, data_cache, run, *overrides), run, before)
    assert __import__("re").search(message, line), line


def test_a_record_from_before_key_kinds_reads_as_frequent_words():
    from posbench.config.upgrade import upgrade

    old = {"scheme": {"name": "rope"}, "eval": {"passkey": {"key_length": 4, "key_vocab": 100}}}
    assert upgrade(old)["eval"]["passkey"]["keys"] == "frequent"
    assert upgrade({"scheme": {"name": "rope"}})["eval"]["passkey"]["keys"] == "digits"  # no probe recorded: today's


def test_a_run_that_trains_on_needles_cannot_resume_with_another_needle_format():
    from posbench.training.states import changed_keys

    def config(rate, keys):
        return {"data": {"passkey_rate": rate}, "eval": {"passkey": {"keys": keys, "key_vocab": 10}, "lengths": [32]}}

    assert changed_keys(config(0.5, "frequent"), config(0.5, "digits")) == ["eval.passkey.keys"]
    assert changed_keys(config(0.0, "frequent"), config(0.0, "digits")) == []  # only the probe changes: resumable


# ---- the probe during training ---------------------------------------------------------------------------------


def test_probe_every_writes_a_curve_to_metrics_and_the_record(data_cache, tmp_path, torch_state):
    """Trained and reported in this process."""
    from posbench.report import render

    run = tmp_path / "run"
    assert train_here(data_cache, run, "eval.probes=[passkey]", "eval.probe_every=3", "eval.passkey.trials=2",
                      "data.passkey_rate=0.5", "data.copy_rate=0.5")["status"] == "complete"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    probes = [r for r in rows if "passkey@32" in r]
    assert [(r["step"], r["tokens"]) for r in probes] == [(3, 3 * 4 * 32), (4, 4 * 4 * 32)]  # every 3 steps, and the last
    assert all(set(r) == {"step", "tokens", "passkey@32", "passkey@64", "transfer@32", "transfer@64"} for r in probes)
    rec = json.loads((run / "results.json").read_text())
    assert [c["step"] for c in rec["probe_curve"]] == [3, 4]
    assert rec["probe_curve"][1]["accuracy"] == {"32": probes[1]["passkey@32"], "64": probes[1]["passkey@64"]}
    assert rec["probe_curve"][1]["transfer"] == {"32": probes[1]["transfer@32"], "64": probes[1]["transfer@64"]}
    assert rec["passkey"]["settings"]["transfer"] == "frequent"  # (digit keys trained: the transfer control's words)
    assert rec["passkey"]["settings"]["keys"] == "digits" and rec["passkey"]["settings"]["key_fraction"] < 1e-3
    assert render.write_report([run], tmp_path / "rep")[1]  # what posbench report runs
    assert (tmp_path / "rep" / "passkey_vs_tokens.png").stat().st_size > 0
    assert "(passkey_vs_tokens.png)" in (tmp_path / "rep" / "report.md").read_text()


def test_probe_curves_average_seeds_per_step_and_keep_each_length():
    from posbench.evaluation import retrieval

    def rec(setting, seed, accs):
        return {"setting": setting, "order": (0, setting), "seed": seed,
                "probe_curve": [{"step": s, "tokens": 100 * s, "accuracy": {"32": a, "64": a / 2}} for s, a in accs]}

    curves = retrieval.probe_curves([rec("rope", 0, [(1, 0.2), (2, 0.6)]), rec("rope", 1, [(1, 0.4), (2, 1.0)]),
                                     rec("alibi", 0, [(2, 0.5)]), {"setting": "nope", "order": (0, "nope"), "seed": 0}])
    assert set(curves) == {"rope", "alibi"}
    assert curves["rope"][32] == ([100, 200], [pytest.approx(0.3), pytest.approx(0.8)])
    assert curves["rope"][64][1] == [pytest.approx(0.15), pytest.approx(0.4)] and curves["alibi"][32] == ([200], [0.5])


def test_posbench_eval_refuses_probe_every(posbench_here, existing_run):
    before = snapshot(existing_run)
    line = refused(posbench_here("eval", f"run={existing_run}", "eval.probe_every=5"), existing_run, before)
    assert line == "eval.probe_every=5 probes during training; posbench eval probes once: drop it"
