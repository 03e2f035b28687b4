"""Training-free extension at evaluation (``eval.remap``, posbench/attention/remap.py; issue 37 item 1) against the reference
algorithms transcribed here, one (query, key) pair at a time:

* StreamingLLM: the KV cache simulated token by token (mit-han-lab/streaming-llm ``StartRecentKVCache``: before
  each new token the cache is cut to its first S and last R entries, then the token is appended; with ``pos_shift``
  every entry's position is its index in the cache, the query's too);
* LM-Infinite: the Λ-shaped mask (i − j < n_local, or j < n_global) and the global branch read at distance d_max;
* ReRoPE: the relative position min(i − j, w); Leaky ReRoPE: i − j below w, else w + (i − j − w)/k;
* Self-Extend: neighbours (i − j < W) at their distance, the rest at ⌊i/G⌋ + W − ⌊W/G⌋ − ⌊j/G⌋;
* Dual Chunk Attention (HKUNLP/ChunkLlama): keys at j mod s, s = c − w; the query at i mod s in its own chunk, at
  min(i mod s + s, c) from the next one, at min(2s − 1, c) from further on.

Each pair's score is RoPE's (or xPos's, or ALiBi's) at that distance, written out with python math per dimension
pair; the attention output in float64 at T = L, 4L and 16L must match the kernel's. Also: the model path, the options'
defaults and refusals, a run re-evaluated from the command line, and its label.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import eval_here, refused, snapshot
from posbench.attention import blockwise, remap, remap_kernel
from posbench.attention.remap import Remap
from posbench.schemes import build_scheme

L, H, DH = 16, 2, 8
METHODS = [Remap("streaming", sinks=2, recent=L - 3), Remap("lm_infinite", n_local=L, n_global=3, d_max=L),
           Remap("rerope", window=4), Remap("leaky_rerope", window=4, leak=4.0), Remap("self_extend", window=4, group=4),
           Remap("dca", chunk=12, window=2)]


def streaming_pairs(T: int, S: int, R: int) -> dict:
    """{(i, j): distance} of the pairs StreamingLLM's cache shows, by simulating the cache."""
    cache, pairs = [], {}
    for i in range(T):
        if len(cache) > S + R:
            cache = cache[:S] + cache[-R:]
        cache.append(i)
        for index, j in enumerate(cache):
            pairs[i, j] = (len(cache) - 1) - index  # positions are cache indices (pos_shift)
    return pairs


def reference_distances(method: Remap, T: int) -> dict:
    """{(i, j): the distance the reference reads} of every pair it shows."""
    if method.method == "streaming":
        return streaming_pairs(T, method.sinks, method.recent)
    pairs = {}
    for i in range(T):
        for j in range(i + 1):
            d = i - j
            if method.method == "lm_infinite":
                if d < method.n_local:
                    pairs[i, j] = d
                elif j < method.n_global:
                    pairs[i, j] = method.d_max
            elif method.method == "rerope":
                pairs[i, j] = min(d, method.window)
            elif method.method == "leaky_rerope":
                w, k = method.window, method.leak
                pairs[i, j] = d if d < w else w + (d - w) / k
            elif method.method == "self_extend":
                W, G = method.window, method.group
                pairs[i, j] = d if d < W else (i // G + W - W // G) - j // G
            else:  # dca, ChunkLlama's names: chunk_size, local_window, chunk_len
                chunk_size, local_window = method.chunk, method.window
                chunk_len = chunk_size - local_window
                key = j % chunk_len
                if i // chunk_len == j // chunk_len:
                    query = i % chunk_len  # intra
                elif i // chunk_len == j // chunk_len + 1:
                    query = min(i % chunk_len + chunk_len, chunk_size)  # successive
                else:
                    query = min(chunk_len - 1 + chunk_len, chunk_size)  # inter
                pairs[i, j] = query - key
    return pairs


def rope_score(q, k, distance: float, base: float = 10000.0, zeta=None, scale_base: float = 512.0) -> float:
    """q·R(distance)·k / √Dh for one head's q (Dh,) and k (Dh,), pairs (a, a + Dh/2) turned by distance·θ_a
    (RoFormer eq. 34); xPos (``zeta``): each pair's term times ζ_a^(distance/B) (Sun et al. 2022, §3.2)."""
    half, total = len(q) // 2, 0.0
    for a in range(half):
        angle = distance * base ** (-2 * a / len(q))
        c, s = math.cos(angle), math.sin(angle)
        # query turned by m, key by n: q_rot·k_rot = (q1 k1 + q2 k2) cos(m − n) + (q1 k2 − q2 k1) sin(m − n)
        term = (q[a] * k[a] + q[a + half] * k[a + half]) * c + (q[a] * k[a + half] - q[a + half] * k[a]) * s
        total += term * (zeta[a] ** (distance / scale_base) if zeta is not None else 1.0)
    return total / math.sqrt(len(q))


def reference_attention(method: Remap, q, k, v, score) -> torch.Tensor:
    """softmax over the shown keys of ``score(h, i, j, distance)`` · v, float64, pair by pair."""
    B, Hn, T, _ = q.shape
    pairs = reference_distances(method, T)
    out = torch.zeros_like(v)
    for h in range(Hn):
        for i in range(T):
            keys = [j for j in range(i + 1) if (i, j) in pairs]
            logits = torch.tensor([score(h, i, j, pairs[i, j]) for j in keys], dtype=torch.float64)
            out[0, h, i] = torch.softmax(logits, 0) @ v[0, h, keys]
    return out


def use(kernel: str, monkeypatch) -> None:
    """Route ``remap_kernel.attend`` through ``kernel``: SDPA's fused one per block (``regions`` or ``rotated``, on CPU), it in
    blocks of 24 queries (…, "blocks of 24": blocks that end mid-window, a short last one), or the per-pair scores
    (CUDA's and bf16's, "per pair")."""
    if kernel == "per pair":
        monkeypatch.setattr(blockwise, "fused_cpu", lambda *args: False)
    elif kernel.endswith("blocks of 24"):
        monkeypatch.setattr(remap_kernel, "FUSED_QUERIES", 24)


def run(scheme, method: Remap, q, k, v, kernel: str = "fused", sink=None) -> torch.Tensor:
    """``remap_kernel.attend`` in float64 (q's dtype), having checked that ``kernel`` (see :func:`use`) is the one that runs."""
    prepared = remap_kernel.prepare(scheme, method, q.shape[2], q.dtype, q.device)
    assert (prepared.plan is not None) == (kernel != "per pair")
    return remap_kernel.attend(q, k, v, scheme, prepared, sink)


def qkv(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, T, DH, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.method)
@pytest.mark.parametrize("T", [L, 4 * L, 16 * L])
@pytest.mark.parametrize("kernel", ["rotated", "rotated, blocks of 24", "per pair"])
def test_rope_attention_matches_the_reference(method, T, kernel, monkeypatch):
    """Through both kernels: one SDPA per region and piece of keys, merged by log-sum-exp (blockwise.rotated, on CPU),
    and each region's q·kᵀ merged in one softmax (CUDA, bf16)."""
    use(kernel, monkeypatch)
    q, k, v = qkv(T, T)
    rope = build_scheme("rope", H * DH, H)
    expected = reference_attention(method, q, k, v, lambda h, i, j, d: rope_score(q[0, h, i], k[0, h, j], d))
    assert_close(run(rope, method, q, k, v, kernel), expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.method)
@pytest.mark.parametrize("kernel", ["rotated", "per pair"])
def test_xpos_attention_matches_the_reference(method, kernel, monkeypatch):
    use(kernel, monkeypatch)
    T = 4 * L
    q, k, v = qkv(T, 1)
    xpos = build_scheme("xpos", H * DH, H, scale_base=64.0)
    zeta = [(2 * a / DH + 0.4) / 1.4 for a in range(DH // 2)]
    expected = reference_attention(method, q, k, v,
                                   lambda h, i, j, d: rope_score(q[0, h, i], k[0, h, j], d, zeta=zeta, scale_base=64.0))
    assert_close(run(xpos, method, q, k, v, kernel), expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.method)
@pytest.mark.parametrize("T", [L, 16 * L])
@pytest.mark.parametrize("kernel", ["regions", "regions, blocks of 24", "per pair"])
def test_alibi_reads_the_remapped_distance(method, T, kernel, monkeypatch):
    """Through both kernels: each region's bias vector in one SDPA per block (blockwise.regions, a bias of the
    distance alone on CPU), and each region's q·kᵀ plus ``pair_bias`` merged in one softmax (every other case)."""
    use(kernel, monkeypatch)
    q, k, v = qkv(T, 2)
    slopes = [2 ** (-8 * h / H) for h in range(1, H + 1)]  # Press et al. 2022, §3

    def score(h, i, j, d):
        return float(q[0, h, i] @ k[0, h, j]) / math.sqrt(DH) - slopes[h] * d

    assert_close(run(build_scheme("alibi", H * DH, H), method, q, k, v, kernel),
                 reference_attention(method, q, k, v, score), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.method)
@pytest.mark.parametrize("T", [L, 4 * L, 16 * L])
def test_each_regions_distances_are_one_vector_read_at_an_offset_per_query(method, T):
    """``Remap.distance_index``: P_q(i) − P_k(j) = D[o(i) + j] for every pair of every region, o ≥ 0."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    region = method.region_of(i, j)
    for r in range(method.regions()):
        o, D = method.distance_index(r, T)
        qp, kp = method.positions(r, T)
        assert o.dtype == torch.long and int(o.min()) == 0 and D.shape == (int(o.max()) + T,)
        pairs = region == r
        assert pairs.any() or T == L  # (at L, LM-Infinite's window covers every key)
        assert torch.equal(D[(o[:, None] + j).expand(T, T)][pairs], (qp[:, None] - kp[None]).expand(T, T)[pairs])


@pytest.mark.parametrize("name", ["t5", "kerple_log", "sandwich"])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.method)
def test_table_schemes_read_the_remapped_distance(name, method):
    """T5 (buckets), KERPLE-log and Sandwich through the regions kernel at 16L: each pair's bias is the scheme's at the
    distance the reference reads (``pair_bias`` of that one distance, as a number)."""
    if name == "t5" and method.method == "leaky_rerope":
        pytest.skip("refused: T5's buckets take whole distances")
    T = 16 * L
    q, k, v = qkv(T, 5)
    scheme = build_scheme(name, H * DH, H)
    with torch.no_grad():
        for p in scheme.parameters():  # away from the initial values, so that heads and distances differ
            p.add_(torch.rand_like(p) * 0.5)
    zero, cache = torch.zeros(1, dtype=torch.long), {}

    def bias(h, d):
        if d not in cache:
            position = torch.tensor([d], dtype=torch.long if float(d).is_integer() else torch.float64)
            cache[d] = scheme.pair_bias(position, zero, torch.float64)[:, 0, 0].tolist()
        return cache[d][h]

    def score(h, i, j, d):
        return float(q[0, h, i] @ k[0, h, j]) / math.sqrt(DH) + bias(h, int(d) if float(d).is_integer() else d)

    assert_close(run(scheme, method, q, k, v), reference_attention(method, q, k, v, score), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kernel", ["regions", "regions, blocks of 24"])
def test_the_regions_kernel_in_float32_with_a_sink_and_a_batch(kernel, monkeypatch):
    """float32 q, k, v against the float64 reference at 16L, a sink logit in each denominator (Self-Extend), and a
    batch of two whose second row is the first's reversed along the heads (each must come out as its own)."""
    use(kernel, monkeypatch)
    T, method = 16 * L, METHODS[4]
    q, k, v = qkv(T, 6)
    sink = torch.tensor([0.4, -0.9], dtype=torch.float64)
    slopes, pairs = [2 ** (-8 * h / H) for h in range(1, H + 1)], reference_distances(method, T)
    expected = torch.zeros_like(v)
    for h in range(H):
        for i in range(T):
            keys = [j for j in range(i + 1) if (i, j) in pairs]
            logits = [float(q[0, h, i] @ k[0, h, j]) / math.sqrt(DH) - slopes[h] * pairs[i, j] for j in keys]
            weights = torch.softmax(torch.tensor(logits + [float(sink[h])], dtype=torch.float64), 0)[:-1]
            expected[0, h, i] = weights @ v[0, h, keys]
    alibi = build_scheme("alibi", H * DH, H)
    assert_close(run(alibi, method, q, k, v, kernel, sink), expected, atol=1e-10, rtol=1e-10)
    q32, k32, v32 = (x.float() for x in (q, k, v))
    got = run(alibi, method, q32, k32, v32, kernel, sink.float())
    assert got.dtype == torch.float32
    assert_close(got.double(), expected, atol=2e-5, rtol=0)
    both = [torch.cat((x, x.flip(1))) for x in (q, k, v)]  # (2, H, T, DH): heads swapped in the second row
    got = run(alibi, method, *both, kernel, sink)
    assert_close(got[0], expected[0], atol=1e-10, rtol=1e-10)
    alone = run(alibi, method, q.flip(1), k.flip(1), v.flip(1), kernel, sink)
    assert_close(got[1], alone[0], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kernel", ["rotated", "rotated, blocks of 24", "per pair"])
def test_a_sink_logit_joins_every_denominator(kernel, monkeypatch):
    """GPT-OSS's sink: exp(s_h) in each query's denominator, no value; with StreamingLLM's mask, at 4L."""
    use(kernel, monkeypatch)
    T, method = 4 * L, METHODS[0]
    q, k, v = qkv(T, 4)
    sink = torch.tensor([0.7, -1.3], dtype=torch.float64)
    pairs, rope = reference_distances(method, T), build_scheme("rope", H * DH, H)
    expected = torch.zeros_like(v)
    for h in range(H):
        for i in range(T):
            keys = [j for j in range(i + 1) if (i, j) in pairs]
            logits = [rope_score(q[0, h, i], k[0, h, j], pairs[i, j]) for j in keys] + [float(sink[h])]
            expected[0, h, i] = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)[:-1] @ v[0, h, keys]
    assert_close(run(rope, method, q, k, v, kernel, sink), expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("method", METHODS[:2], ids=lambda m: m.method)
@pytest.mark.parametrize("kernel", ["regions", "regions, blocks of 24", "per pair"])
def test_nope_and_an_absolute_scheme_keep_only_the_mask(method, kernel, monkeypatch):
    """NoPE (and learned or sinusoidal positions, added to the embeddings) reads no distance: only the keys a method
    hides change its attention."""
    use(kernel, monkeypatch)
    T = 4 * L
    q, k, v = qkv(T, 3)
    expected = reference_attention(method, q, k, v, lambda h, i, j, d: float(q[0, h, i] @ k[0, h, j]) / math.sqrt(DH))
    assert_close(run(build_scheme("nope", H * DH, H), method, q, k, v, kernel), expected, atol=1e-10, rtol=1e-10)


def test_a_model_with_a_remap_that_hides_nothing_is_the_model():
    """Through the model, every layer's attention remapped: a method whose windows cover the whole evaluation window
    gives the model's own logits; one that acts does not."""
    from posbench.model.build import build_model

    torch.manual_seed(0)
    model = build_model({"vocab_size": 50, "model": {"n_layer": 2, "n_head": H, "d_model": H * DH, "d_ff": 32},
                         "scheme": {"name": "rope"}}).double().eval()
    idx = torch.randint(0, 50, (2, 3 * QUERIES_PLUS))
    with torch.no_grad():
        plain = model(idx)
        model.remap = Remap("rerope", window=idx.shape[1])
        assert_close(model(idx), plain, atol=1e-12, rtol=1e-12)
        model.remap = Remap("rerope", window=8)
        changed = (model(idx) - plain).abs()
        assert changed[:, :8].max() < 1e-12 and changed[:, 8:].max() > 1e-6  # (GPT-2's initialisation: small logits)


QUERIES_PLUS = remap_kernel.FUSED_QUERIES // 2 + 1  # T = 3·(Q/2 + 1): blocks that end mid-window


def test_defaults_are_the_papers_scaled_to_L():
    assert remap.defaults("streaming", 128, 2048) == {"sinks": 4, "recent": 123}  # S + R = L − 1: distances < L
    assert remap.defaults("lm_infinite", 128, 2048) == {"n_local": 128, "n_global": 10, "d_max": 128}
    assert remap.defaults("rerope", 128, 2048) == {"window": 16}  # 512 at L = 4096
    assert remap.defaults("leaky_rerope", 128, 2048) == {"window": 16, "leak": 16.0}
    se = remap.defaults("self_extend", 128, 2048)
    assert se == {"window": 32, "group": 32}  # 1024 at 4096; G: the smallest power of two that fits 2048 in L
    assert (2048 - 1) // 32 + 32 - 1 <= 127 < (2048 - 1) // 16 + 32 - 2
    assert remap.defaults("dca", 128, 2048) == {"chunk": 96, "window": 16}  # 3072 and 512 at 4096


@pytest.mark.parametrize("L, T", [(32, 32), (32, 64), (96, 1536), (100, 1600), (128, 2048), (128, 4096), (512, 8192)])
def test_self_extends_defaults_pass_its_own_checks_and_keep_positions_within_L(L, T):
    options = remap.Options()
    remap.check("self_extend", options, L, T)
    W, G = options.window, options.group
    assert W % G == 0 and G >= 2 and (T - 1) // G + W - W // G <= L - 1  # the farthest grouped query position


def test_self_extend_without_a_default_that_fits_says_so():
    with pytest.raises(ValueError, match=r"no default that keeps 512 tokens within the train length L=32"):
        remap.check("self_extend", remap.Options(), 32, 512)


@pytest.mark.parametrize("method, options, message", [
    ("leaky_rerope", {"leak": 1.0}, r"leak=1.0 is not allowed: it must be a finite number > 1"),
    ("leaky_rerope", {"leak": math.inf}, r"leak=inf is not allowed"),
    ("self_extend", {"window": 8, "group": 1}, r"group=1 is not allowed: it must be a finite number >= 2"),
    ("streaming", {"sinks": 4, "recent": 59}, r"recent=59 reaches the longest evaluation length 64"),  # S + R + 1
    ("dca", {"chunk": 70, "window": 6}, r"chunk=70 reaches the longest evaluation length 64"),  # c − w ≥ T
])
def test_settings_that_would_change_nothing_are_refused(method, options, message):
    with pytest.raises(ValueError, match=message):
        remap.check(method, remap.Options(**options), 16, 64)


@pytest.mark.parametrize("scheme, method, message", [
    ({"name": "nope"}, "rerope", r"eval.remap=rerope changes only the distances .* scheme=nope reads none"),
    ({"name": "learned"}, "dca", r"scheme=learned reads none"),
    ({"name": "rope", "scaling": "dynamic_ntk"}, "streaming", r"scheme.scaling=dynamic_ntk"),
    ({"name": "t5"}, "leaky_rerope", r"scheme=t5's buckets take whole ones"),
    ({"name": "cope"}, "rerope", r"scheme=cope computes its positions from the content"),
])
def test_a_remap_a_scheme_cannot_take_is_refused(scheme, method, message):
    from omegaconf import OmegaConf

    from posbench.config.checks import ConfigError
    from posbench.config.eval_checks import remap_values
    from posbench.config.schema import EvalConfig, ModelConfig

    e = OmegaConf.merge(OmegaConf.structured(EvalConfig), {"remap": method, "lengths": [16, 64]})
    with pytest.raises(ConfigError, match=message):
        remap_values(e, OmegaConf.structured(ModelConfig), OmegaConf.create(scheme), 16, training=False)
    if scheme["name"] in ("nope", "learned"):  # the methods that also hide keys do act on them
        e.remap, e.remap_options = "streaming", OmegaConf.structured(remap.Options)
        remap_values(e, OmegaConf.structured(ModelConfig), OmegaConf.create(scheme), 16, training=False)


def test_a_fine_tuned_runs_remap_is_labelled_alike_with_and_without_a_temperature():
    from posbench.report.records import _mark_reevaluations
    from posbench.report.settings import label_of

    cfg = {"scheme": {"name": "rope"}, "train": {"seq_len": 512, "steps": 200}, "model": {}, "eval": {}}
    remapped = {"remap": "rerope", "remap_options": {"window": 64}}
    lineage = {"scheme": "rope", "origin_length": 128}
    run = [{"path": "r/results.json", "config": cfg, "lineage": lineage},
           {"path": "r/eval-1.json", "config": {**cfg, "eval": remapped}, "lineage": lineage},
           {"path": "r/eval-2.json", "config": {**cfg, "eval": remapped, "model": {"attn_scale": "log_n_clipped"}},
            "lineage": lineage, "model_overrides": {"attn_scale": "log_n_clipped"}}]
    _mark_reevaluations(run)
    assert [label_of(r) for r in run] == ["rope ft512×200", "rope@rerope(w64) ft512×200",
                                          "rope@rerope(w64) ft512×200 (log_n_clipped at eval)"]


REFUSALS = [
    (["eval.remap=self_extend", "eval.remap_options.window=24", "eval.remap_options.group=16"],
     r"eval.remap_options.window=24 is not divisible by eval.remap_options.group=16"),
    (["eval.remap=rerope", "eval.remap_options.window=512"],  # posbench eval's lengths: L … 16L, L = 32
     r"eval.remap_options.window=512 reaches the longest evaluation length 512: eval.remap=rerope would change nothing"),
    (["eval.remap=rerope", "eval.remap_options.group=4"], r"eval.remap_options.group=4 is not a parameter of "
                                                          r"eval.remap=rerope \(window\): drop it"),
    (["eval.remap_options.window=4"], r"eval.remap_options.window=4 is not a parameter of eval.remap=none"),
    (["eval.remap=leaky_rerope", "eval.remap_options.leak=0.5"], r"eval.remap_options.leak=0.5 is not allowed"),
    (["eval.remap=streaming", "eval.remap_options.recent=0"], r"eval.remap_options.recent=0 is not allowed"),
]


@pytest.mark.parametrize("overrides,message", REFUSALS)
def test_bad_remaps_are_refused_and_nothing_written(overrides, message, posbench_here, existing_run):
    before = snapshot(existing_run)
    proc = posbench_here("eval", f"run={existing_run}", *overrides)
    assert re.search(message, refused(proc, existing_run, before))


def test_training_refuses_a_remap(posbench_here, data_cache, tmp_path):
    run = tmp_path / "run"
    proc = posbench_here("train", "debug=fast", "eval.remap=rerope", f"hydra.run.dir={run}", f"data.cache_dir={data_cache}")
    assert proc.returncode == 2 and "eval.remap=rerope applies to a trained run: posbench eval" in proc.stderr
    assert not run.exists()


def test_posbench_eval_with_self_extends_defaults(existing_run, torch_state):
    """L = 32 evaluated to 128: the smallest G that keeps ⌊127/G⌋ + W − W/G below L, W the multiple of G nearest
    L/4 = 8: G = 8, W = 8."""
    got = eval_here(f"run={existing_run}", "eval.lengths=[32,128]", "eval.max_tokens=256", "eval.remap=self_extend")
    assert got["label"] == "rope@self_extend(W8,G8)"
    assert got["config"]["eval"]["remap_options"]["group"] == 8 and got["config"]["eval"]["remap_options"]["window"] == 8


def test_posbench_eval_remaps_a_trained_run(existing_run, torch_state):
    """``posbench eval run=<rope run> eval.remap=rerope``: L = 32 evaluated at 32 and 128 with ReRoPE's default
    w = L/8 = 4, labelled ``rope@rerope(w4)``; at L a window of 4 already acts, so both lengths change."""
    plain = eval_here(f"run={existing_run}", "eval.lengths=[32,128]", "eval.max_tokens=256")
    got = eval_here(f"run={existing_run}", "eval.lengths=[32,128]", "eval.max_tokens=256", "eval.remap=rerope")
    assert got["label"] == "rope@rerope(w4)" and got["config"]["eval"]["remap_options"]["window"] == 4
    assert all(a["nll"] != b["nll"] for a, b in zip(got["results"], plain["results"]))
    written = json.loads((existing_run / "eval-rope@rerope_w4-nonoverlapping-validation-1.json").read_text())
    assert written["label"] == "rope@rerope(w4)"
    hot = eval_here(f"run={existing_run}", "eval.lengths=[32,128]", "eval.max_tokens=256", "eval.remap=rerope",
                    "model.attn_scale=log_n_clipped")
    assert hot["label"] == "rope@rerope(w4) (log_n_clipped at eval)"
    from posbench.report.records import collect
    from posbench.report.settings import label_of

    records, skipped = collect([existing_run])
    assert {"rope", "rope@rerope(w4)", "rope@rerope(w4) (log_n_clipped at eval)"} <= {label_of(r) for r in records}
    assert not [line for line in skipped if "duplicate" in line]


def test_the_remaps_preset_sweeps_every_method_with_and_without_a_temperature():
    """``posbench eval -m eval_experiment=remaps run=…``: every method of eval.remap (none included) × no temperature
    and log_n_clipped, with the context probe, composed as the command line composes it."""
    from hydra import compose, initialize_config_module

    from posbench.cli import register

    register()
    with initialize_config_module("posbench.conf", version_base="1.3"):
        cfg = compose("eval", overrides=["eval_experiment=remaps", "run=x"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert params["eval.remap"].split(",") == list(remap.METHODS)
    assert params["model.attn_scale"].split(",") == ["none", "log_n_clipped"] and list(cfg.eval.probes) == ["context"]


# ---- the plan's bookkeeping: spans without host reads, masks made once ----------------------------------------------


class Ops(TorchDispatchMode):
    """The ATen operators run inside it, by name (``aten.nonzero``, ``aten._local_scalar_dense``: a host read)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.method)
def test_a_regions_keys_in_a_block_are_those_its_pairs_span(method):
    """``Remap.key_span`` against every pair's region (``region_of``): for blocks of 1, 7 and 64 queries anywhere in
    a window of 16L, the first and last key any query of the block sees in each region (or none)."""
    T = 16 * L
    region = method.region_of(torch.arange(T)[:, None], torch.arange(T)[None, :])  # (T, T)
    for Q in (1, 7, 64):
        for s in range(0, T, Q):
            e = min(T, s + Q)
            for r in range(method.regions()):
                keys = (region[s:e] == r).any(0).nonzero()[:, 0].tolist()
                lo, hi = method.key_span(r, s, e)
                assert (lo, hi) == (keys[0], keys[-1] + 1) if keys else hi <= lo, (Q, s, r, lo, hi, keys[:3], keys[-3:])


@pytest.mark.parametrize("scheme_name", ["rope", "alibi"])
def test_preparing_the_per_pair_kernel_reads_nothing_back_per_block(scheme_name, monkeypatch):
    """The per-pair kernel's blocks (CUDA's, bf16's) find each region's keys without a host read per block: a window
    of ten times as many blocks reads back from the device as often as one of one block."""
    monkeypatch.setattr(blockwise, "fused_cpu", lambda *args: False)
    scheme = build_scheme(scheme_name, d_model=H * DH, n_head=H)
    reads = []
    for T in (remap_kernel.QUERIES, 10 * remap_kernel.QUERIES):
        with Ops() as ops:
            prepared = remap_kernel.prepare(scheme, Remap("self_extend", window=8, group=4), T, torch.float32, "cpu")
        assert len(prepared.blocks) == T // remap_kernel.QUERIES
        reads.append(sum(n in ("aten.nonzero", "aten._local_scalar_dense", "aten.item") for n in ops.names))
    assert reads[0] == reads[1], reads


def test_the_rotated_kernel_makes_a_mixed_pieces_mask_once_per_dtype():
    """Self-Extend's plan has pieces where its regions mix; the rotated kernel's float mask of each is made on the
    first pass and kept with the plan: a second pass (every layer, every batch of one length) makes none."""
    remap_kernel.fused_plan.cache_clear()
    scheme, method, T = build_scheme("rope", d_model=H * DH, n_head=H), Remap("self_extend", window=8, group=4), 8 * L
    q, k, v = qkv(T, seed=5)
    prepared = remap_kernel.prepare(scheme, method, T, q.dtype, q.device)
    assert any(inside for block in prepared.plan for *_, inside, _ in block.pieces)  # (mixed pieces to mask)
    made, outputs = [], []
    for _ in range(2):
        with Ops() as ops:
            outputs.append(remap_kernel.attend(q, k, v, scheme, prepared))
        made.append(ops.names.count("aten.masked_fill_"))
    assert made[0] > 0 and made[1] == 0, made
    assert torch.equal(outputs[0], outputs[1])
