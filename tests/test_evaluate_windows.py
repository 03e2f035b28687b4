"""Evaluation accounting (docs/design.md §6): every target 1…n scored exactly once under each protocol, by
expanding ``posbench.evaluation.perplexity.windows``; ``span``; and ``evaluate`` against naive loops: per target, per
window (the per-position curve and its bins, ``window_nll`` / ``window_tokens``, docs/design.md §7).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from helpers import kept_torch_state
from posbench.evaluation.perplexity import evaluate, span, windows
from posbench.model.build import build_model

# ---- windows --------------------------------------------------------------------------------------


def scored_targets(wins, n):
    """Expand windows (start, size, first) into the targets they score; check each window stays in 0…n."""
    out = []
    for start, size, first in wins:
        assert start >= 0 and size >= 1 and 0 <= first < size, (start, size, first)
        assert start + size <= n, f"window {(start, size, first)} reads past the stream of {n} + 1 tokens"
        out += range(start + first + 1, start + size + 1)  # input index i predicts token i + 1
    return out


def assert_each_once(wins, n):
    counts = Counter(scored_targets(wins, n))
    missing = [t for t in range(1, n + 1) if counts[t] == 0]
    twice = {t: c for t, c in counts.items() if c > 1}
    outside = [t for t in counts if not 1 <= t <= n]
    assert not missing and not twice and not outside, f"missing {missing[:10]}, repeated {twice}, outside {outside}"


CASES = [(n, length) for n in (1, 2, 5, 31, 32, 33, 64, 100, 127, 128, 129) for length in (1, 2, 3, 8, 32, 50, 128)]


@pytest.mark.parametrize("n, length", CASES)
def test_nonoverlapping_scores_every_target_once(n, length):
    wins = windows(n, length, "nonoverlapping")
    assert_each_once(wins, n)
    assert all(size <= length for _, size, _ in wins)
    assert all(first == 0 for _, _, first in wins)  # nothing is thrown away
    assert [s for s, _, _ in wins] == list(range(0, n, length))  # consecutive, disjoint windows
    assert len(wins) == math.ceil(n / length)


@pytest.mark.parametrize("n, length", CASES)
def test_sliding_scores_every_target_once(n, length):
    strides = sorted({1, min(2, length), max(1, length // 3), max(1, length - 1), length})
    for stride in strides:
        wins = windows(n, length, "sliding", stride)
        assert_each_once(wins, n)
        size = min(length, n)
        assert all(s == size for _, s, _ in wins), "sliding windows are all full-size"
        assert wins[0] == (0, size, 0)  # the first window scores all its targets
        for _, s, first in wins[1:]:
            # later windows score at most their last S targets, so each sees >= L − S tokens of context
            assert first >= s - stride


def test_sliding_with_stride_equal_length_is_nonoverlapping_when_it_divides():
    for n, length in [(128, 32), (96, 8), (50, 5)]:
        assert windows(n, length, "sliding", length) == windows(n, length, "nonoverlapping")


def test_sliding_stride_one_scores_one_new_target_per_window():
    n, length = 40, 8
    wins = windows(n, length, "sliding", 1)
    assert len(wins) == 1 + (n - length)
    assert all((s, size, first) == (t - length, length, length - 1)
               for t, (s, size, first) in zip(range(length + 1, n + 1), wins[1:]))


@pytest.mark.parametrize("bad", [0, -1, 9, None])
def test_sliding_rejects_bad_stride(bad):
    with pytest.raises(ValueError):
        windows(40, 8, "sliding", bad)


def test_unknown_protocol():
    with pytest.raises(ValueError):
        windows(40, 8, "diagonal")


# ---- span -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("available, lengths, max_tokens", [
    (1000, [32, 64], 256), (1000, [32, 64], 300), (1000, [32, 64], 10_000), (65, [32, 64], 256),
    (1000, [48, 32], 500), (200, [128], 16), (129, [128], 16384),
])
def test_span(available, lengths, max_tokens):
    n = span(available, lengths, max_tokens)
    longest = max(lengths)
    assert n % longest == 0 and n >= longest  # a whole number of the longest windows
    assert n <= available - 1  # every target has a token to predict it from
    assert n <= max(max_tokens, longest)


@pytest.mark.parametrize("available", [0, 1, 10, 64])
def test_span_rejects_short_split_and_says_how_many_tokens(available):
    with pytest.raises(ValueError) as info:
        span(available, [32, 64], 256)
    assert str(available) in str(info.value) and "64" in str(info.value)


# ---- evaluate -------------------------------------------------------------------------------------

VOCAB = 47


def tiny_model(name):
    torch.manual_seed(0)
    spec = {"vocab_size": VOCAB, "scheme": {"name": name, **({"max_positions": 64} if name == "learned" else {})},
            "model": {"n_layer": 1, "n_head": 2, "d_model": 16, "d_ff": 32, "dropout": 0.0, "scale_embeddings": True}}
    model = build_model(spec)
    for p in model.parameters():  # a sharper random model: per-token losses differ visibly
        torch.nn.init.normal_(p, std=0.5)
    return model


@pytest.fixture(scope="module")
def stream():
    return np.random.default_rng(0).integers(0, VOCAB, 301).astype(np.uint16)


def naive_nll(model, tokens, n, length, protocol, stride=None):
    """Total NLL of targets 1…n, each scored from an explicit context window, one target at a time (a window's
    forward pass is run once and its logits kept for the other targets scored from the same window)."""
    tokens = torch.from_numpy(tokens.astype(np.int64))
    total = 0.0
    outputs: dict[tuple[int, int], torch.Tensor] = {}  # (start, end) → the window's logits
    with torch.no_grad():
        for t in range(1, n + 1):
            if protocol == "nonoverlapping":
                start = (t - 1) // length * length  # the window holding input t − 1
            else:
                # sliding: targets 1…L come from the first window; later ones from the first window that
                # ends at or after them with them in its last S positions (context ≥ L − S)
                size = min(length, n)
                if t <= size:
                    start = 0
                else:
                    end = size + math.ceil((t - size) / stride) * stride  # last target of that window
                    start = min(end, n) - size
            end = min(start + length, n)
            if (start, end) not in outputs:
                outputs[start, end] = model(tokens[start:end][None])[0]
            logits = outputs[start, end][t - 1 - start]
            total += F.cross_entropy(logits[None], tokens[t][None]).item()
    return total


@pytest.mark.parametrize("name", ["rope", "alibi", "learned"])
def test_sliding_with_stride_equal_length_equals_nonoverlapping(name, stream):
    model = tiny_model(name)
    for length in (8, 16, 32):
        non = evaluate(model, stream, [length], "nonoverlapping", max_tokens=128)[0]
        sli = evaluate(model, stream, [length], "sliding", stride=length, max_tokens=128)[0]
        assert non["tokens"] == sli["tokens"] == 128
        assert_close(sli["ppl"], non["ppl"], rtol=1e-6, atol=0)
        assert_close(sli["nll"], non["nll"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["rope", "alibi"])
@pytest.mark.parametrize("protocol, stride", [("nonoverlapping", None), ("sliding", 1), ("sliding", 3), ("sliding", 8)])
def test_evaluate_matches_naive_per_target_loop(name, protocol, stride, stream):
    model = tiny_model(name)
    lengths = [8, 12, 24]  # 12 does not divide the span of 48: ragged windows
    rows = evaluate(model, stream, lengths, protocol, stride=stride, max_tokens=50, batch_tokens=40)
    n = span(len(stream), lengths, 50)
    assert n == 48
    for row, length in zip(rows, lengths):
        assert row["length"] == length and row["tokens"] == n  # the same span at every length
        expected = naive_nll(model, stream, n, length, protocol, stride)
        assert_close(row["nll"], expected / n, rtol=1e-5, atol=1e-6)
        assert_close(row["ppl"], math.exp(expected / n), rtol=1e-5, atol=1e-6)
        pos = row["nll_by_position"]
        assert len(pos["position"]) == len(pos["nll"]) and pos["position"][0] == 0


def test_evaluate_restores_training_mode(stream):
    model = tiny_model("rope").train()
    evaluate(model, stream, [8], max_tokens=16)
    assert model.training
    model.eval()
    evaluate(model, stream, [8], max_tokens=16)
    assert not model.training


@pytest.mark.parametrize("length", [2, 7, 64, 128, 2048, 16384])
def test_position_bins_partition_the_window(length):
    from posbench.evaluation.perplexity import position_bins

    edges = position_bins(length).tolist()
    assert edges[0] == 0 and all(b > a for a, b in zip(edges, edges[1:])) and edges[-1] < length
    widths = [b - a for a, b in zip(edges, [*edges[1:], length])]
    assert min(widths[:-1] or [1]) >= max(1, length // 128)  # no bin averages fewer than length/128 positions
    assert len(edges) <= 64


# ---- per window and per position, against a naive window-by-window loop ---------------------------


def protocol_windows(n: int, length: int, protocol: str, stride: int | None = None) -> list[tuple[int, list[int]]]:
    """The windows a protocol defines over targets 1…n, written from its definition (not from ``windows``):
    (first input index, scored targets), the window's inputs being tokens[start : start + its size].

    nonoverlapping: consecutive windows of ``length`` inputs, each scoring every target it predicts; the last
    one holds what is left. sliding: window k starts at k·S and scores what it adds at its end (window 0
    scores all its targets); a window that would read past the stream is moved back to end at its end and
    scores only the targets not yet scored.
    """
    if protocol == "nonoverlapping":
        out, start = [], 0
        while start < n:
            inputs = min(length, n - start)
            out.append((start, list(range(start + 1, start + inputs + 1))))
            start += inputs
        return out
    size = min(length, n)
    out, done, k = [(0, list(range(1, size + 1)))], size, 1
    while done < n:
        start = min(k * stride, n - size)
        out.append((start, list(range(done + 1, start + size + 1))))
        done, k = start + size, k + 1
    return out


def naive_window_nll(model, tokens: np.ndarray, n: int, length: int, protocol: str, stride: int | None):
    """One forward pass per window: per window the summed NLL (nats) of its scored targets and their count,
    and per position index of the window the summed NLL and count of the targets scored there."""
    ids = torch.from_numpy(tokens.astype(np.int64))
    pos_sum, pos_count = [0.0] * length, [0] * length
    win_nll, win_tokens = [], []
    with torch.no_grad():
        for start, targets in protocol_windows(n, length, protocol, stride):
            size = targets[-1] - start  # the window's inputs: start … start + size − 1
            logp = torch.log_softmax(model(ids[start: start + size][None])[0].double(), dim=-1)  # (size, V)
            total = 0.0
            for t in targets:
                i = t - 1 - start  # the position in the window whose output predicts token t
                nll = -logp[i, ids[t]].item()
                pos_sum[i] += nll
                pos_count[i] += 1
                total += nll
            win_nll.append(total)
            win_tokens.append(len(targets))
    return win_nll, win_tokens, pos_sum, pos_count


WINDOW_CASES = [("nonoverlapping", None), ("sliding", 5), ("sliding", 3), ("sliding", 1)]
WINDOW_LENGTHS = [8, 20, 24]  # 20 does not divide the span of 48 (a ragged last window); 5 divides no length


@pytest.fixture(scope="module")
def window_rows(stream):
    """(model, rows, n) per (scheme, protocol, stride), evaluated once for the tests below."""
    cache = {}

    def get(name, protocol, stride):
        if (name, protocol, stride) not in cache:
            model = tiny_model(name)
            rows = evaluate(model, stream, WINDOW_LENGTHS, protocol, stride=stride, max_tokens=50, batch_tokens=40)
            cache[name, protocol, stride] = model, rows, span(len(stream), WINDOW_LENGTHS, 50)
        return cache[name, protocol, stride]

    return get


def test_protocol_windows_cover_the_span_once():
    """The test's own window lists score every target once (so a disagreement below is the evaluator's)."""
    for protocol, stride in WINDOW_CASES:
        for length in WINDOW_LENGTHS:
            wins = protocol_windows(48, length, protocol, stride)
            assert sorted(t for _, ts in wins for t in ts) == list(range(1, 49))
            for start, ts in wins:
                assert ts == list(range(ts[0], ts[-1] + 1)) and ts[-1] - start <= length and start >= 0


@pytest.mark.parametrize("name", ["alibi", "sinusoidal"])
@pytest.mark.parametrize("protocol, stride", WINDOW_CASES)
def test_nll_by_position_matches_a_naive_window_loop(name, protocol, stride, window_rows, stream):
    from posbench.evaluation.perplexity import position_bins

    model, rows, n = window_rows(name, protocol, stride)
    for row, length in zip(rows, WINDOW_LENGTHS):
        _, _, pos_sum, pos_count = naive_window_nll(model, stream, n, length, protocol, stride)
        edges = row["nll_by_position"]["position"]
        assert edges == position_bins(length).tolist()
        bounds = [*edges[1:], length]
        assert all(sum(pos_count[a:b]) > 0 for a, b in zip(edges, bounds))  # every bin holds scored targets
        expected = [sum(pos_sum[a:b]) / sum(pos_count[a:b]) for a, b in zip(edges, bounds)]
        assert_close(row["nll_by_position"]["nll"], expected, rtol=1e-5, atol=1e-6,
                     msg=lambda m: f"length {length}: {m}")
        # the bins weigh positions by their targets: the token-weighted mean of the bins is the row's NLL
        counts = [sum(pos_count[a:b]) for a, b in zip(edges, bounds)]
        weighted = sum(c * v for c, v in zip(counts, row["nll_by_position"]["nll"])) / sum(counts)
        assert weighted == pytest.approx(row["nll"], rel=1e-9)


@pytest.mark.parametrize("name", ["alibi", "sinusoidal"])
@pytest.mark.parametrize("protocol, stride", WINDOW_CASES)
def test_window_nll_matches_a_naive_window_loop(name, protocol, stride, window_rows, stream):
    model, rows, n = window_rows(name, protocol, stride)
    for row, length in zip(rows, WINDOW_LENGTHS):
        win_nll, win_tokens, _, _ = naive_window_nll(model, stream, n, length, protocol, stride)
        assert row["windows"] == len(win_nll), "one entry per window of the protocol"
        assert row["window_tokens"] == win_tokens, f"length {length}: targets scored per window"
        assert len(row["window_nll"]) == len(win_nll)
        assert sum(row["window_tokens"]) == row["tokens"] == n
        assert all(isinstance(c, int) for c in row["window_tokens"])
        assert_close(row["window_nll"], win_nll, rtol=1e-5, atol=1e-5, msg=lambda m: f"length {length}: {m}")
        assert sum(row["window_nll"]) == pytest.approx(row["nll"] * row["tokens"], rel=1e-9)
        assert row["window_tokens"] == [size - first for _, size, first in windows(n, length, protocol, stride)]


def test_window_nll_is_json_plain(window_rows):
    """Rows go into results.json as they are: plain floats and ints, no tensors or numpy scalars."""
    import json

    _, rows, _ = window_rows("alibi", "sliding", 5)
    for row in rows:
        assert json.loads(json.dumps(row["window_nll"])) == row["window_nll"]
        assert all(type(v) is float for v in row["window_nll"])


# ---- sharded over ranks ----------------------------------------------------------------------------


def _sharded_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import json

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tokens = np.random.default_rng(0).integers(0, VOCAB, 301).astype(np.uint16)
        rows = evaluate(tiny_model("alibi"), tokens, [8, 20], "sliding", stride=3, max_tokens=50, batch_tokens=40,
                        rank=rank, world=world)
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def test_sharded_windows_come_back_in_order(stream, tmp_path):
    """Two gloo ranks each score every other window; every rank returns the windows in ``windows`` order,
    with the values a single process gives."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_sharded_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    single = evaluate(tiny_model("alibi"), stream, [8, 20], "sliding", stride=3, max_tokens=50, batch_tokens=40)
    for rank in (0, 1):
        rows = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for got, want in zip(rows, single, strict=True):
            assert got["window_tokens"] == want["window_tokens"] and got["tokens"] == want["tokens"]
            assert_close(got["window_nll"], want["window_nll"], rtol=1e-5, atol=1e-5)
            assert_close(got["nll"], want["nll"], rtol=1e-6, atol=0)


def test_evaluation_flushes_denormals_on_cpu_and_only_while_it_runs(monkeypatch):
    """posbench.runtime.device.flush_denormals, as evaluate() scores: inside, an fp32 result below 2^−126 reads 0 (Intel CPUs
    take a slow path for each one, and a long ALiBi window's softmax has thousands per query); outside, IEEE's
    denormal again (in a process that does not flush for good)."""
    from posbench.runtime import device

    monkeypatch.setattr(device, "_flushing", False)
    torch.set_flush_denormal(False)  # (an in-process training run earlier in this session turned it on for good)
    tiny = torch.tensor([1e-30])  # (1e-30 · 1e-10 = 1e-40: a float32 denormal)
    assert (tiny * 1e-10).item() > 0
    with device.flush_denormals("cpu"):
        assert (tiny * 1e-10).item() == 0.0
    assert (tiny * 1e-10).item() > 0


def test_a_cpu_training_process_flushes_denormals_for_good():
    """posbench train's process set-up flushes denormals on CPU from then on (KERPLE power's training softmax is full
    of them), and an evaluation's flush_denormals block inside it does not turn IEEE's behaviour back on."""
    from posbench.runtime import device
    from posbench.training.loop import start_process

    tiny = torch.tensor([1e-30])  # (1e-30 · 1e-10 = 1e-40: a float32 denormal)
    with kept_torch_state():
        device._flushing = False
        torch.set_flush_denormal(False)
        assert (tiny * 1e-10).item() > 0
        start_process("cpu", torch.get_num_threads(), 0)
        assert (tiny * 1e-10).item() == 0.0
        with device.flush_denormals("cpu"):
            pass
        assert (tiny * 1e-10).item() == 0.0


def test_windows_that_miss_targets_raise_a_real_error(monkeypatch):
    """The coverage invariant holds in production, not only under a debugger: a real error (``python -O`` strips
    asserts)."""
    from posbench.evaluation import perplexity as ev

    model = build_model({"vocab_size": 50, "model": {"n_layer": 1, "n_head": 2, "d_model": 16, "d_ff": 32},
                         "scheme": {"name": "nope"}})
    real = ev.windows
    monkeypatch.setattr(ev, "windows", lambda *a, **k: real(*a, **k)[:-1])  # a window lost: targets unscored
    tokens = np.random.default_rng(0).integers(0, 50, 400)
    with pytest.raises(RuntimeError, match="scored .* targets, expected"):
        ev.evaluate(model, tokens, [32], "nonoverlapping", None, 256, 1024, torch.device("cpu"))
