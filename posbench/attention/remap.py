"""Training-free extension at evaluation (``eval.remap``): the methods deployed RoPE models use to run past their
training length, each keeping every distance a model reads within what it trained on.

Each method splits the causal pairs (query i, key j ≤ i; d = i − j; indices in the evaluation window) into regions,
the pairs it hides in none, and scores region r at remapped positions (P_q^r(i), P_k^r(j)) — each a function of i or
of j alone. The softmax runs once over every region's scores (:func:`attend`), so a query's attention is exactly
one distribution over the keys it sees. For a rotary scheme a region's positions turn the query and the key
(``scheme.rotation``/``rotate`` with separate key tables); for a bias scheme they are what the bias reads
(``scheme.pair_bias``); NoPE and the schemes that add positions to the embeddings (sinusoidal, learned) read no
position per pair, so only the method's mask applies to them.

=============== ======================================================== ==================================================
method          regions (d = i − j)                                      positions
=============== ======================================================== ==================================================
``streaming``   recent: d ≤ R; sinks: j < S, d > R; hidden: the rest     recent: (i, j); sinks: (min(i, S + R), j)
``lm_infinite`` local: d < n_local; global: j < n_global, d ≥ n_local    local: (i, j); global: (d_max, 0)
``rerope``      near: d < w; far: d ≥ w                                  near: (i, j); far: (w, 0)
``leaky_rerope`` near: d < w; far: d ≥ w                                 near: (i, j); far: (w + (i − w)/k, j/k)
``self_extend`` neighbours: d < W; grouped: d ≥ W                        (i, j); (⌊i/G⌋ + W − ⌊W/G⌋, ⌊j/G⌋)
``dca``         intra: ⌊i/s⌋ = ⌊j/s⌋; successive: ⌊i/s⌋ = ⌊j/s⌋ + 1;     (i mod s, j mod s); (min(i mod s + s, c), j mod s);
                inter: ⌊i/s⌋ ≥ ⌊j/s⌋ + 2 (s = c − w)                     (min(2s − 1, c), j mod s)
=============== ======================================================== ==================================================

Sources: StreamingLLM (Xiao et al. 2023; mit-han-lab/streaming-llm ``StartRecentKVCache`` and ``pos_shift``: a cache
of S start and R recent tokens, the new token appended after it is trimmed, positions those in the cache); LM-Infinite
(Han et al. 2023, Glaciohound/LM-Infinite: a Λ-shaped mask, the global keys unrotated and the query at d_max);
ReRoPE and Leaky ReRoPE (Su 2023, bojone/rerope); Self-Extend (Jin et al. 2024, datamllab/LongLM
``self_extend_patch``); Dual Chunk Attention (An et al. 2024, HKUNLP/ChunkLlama ``chunkllama_attn_replace``: chunk size
c, local window w, keys at their position within a chunk of s = c − w; the paper's Eqs. 2, 5 and 7 cap at c − 1, its
code at c, which this follows; the code's later temperature for lengths past L, which the paper's results do not use,
is not part of it).

    remap = Remap("self_extend", window=32, group=32)
    model.remap = remap     # posbench/model/gpt.py: every layer's attention then runs :func:`attend`
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import Optional

import torch

from posbench.attention import blockwise

METHODS = ("none", "streaming", "lm_infinite", "rerope", "leaky_rerope", "self_extend", "dca")  # eval.remap
PARAMETERS = {  # each method's options (eval.remap_options.<name>), in label order
    "streaming": ("sinks", "recent"),
    "lm_infinite": ("n_local", "n_global", "d_max"),
    "rerope": ("window",),
    "leaky_rerope": ("window", "leak"),
    "self_extend": ("window", "group"),
    "dca": ("chunk", "window"),
}
SHORT = {"sinks": "S", "recent": "R", "n_local": "local", "n_global": "global", "d_max": "dmax", "window": "w",
         "leak": "k", "group": "G", "chunk": "c"}  # in labels: rope@rerope(w16)
QUERIES = 64  # queries per block of :func:`attend`'s scores
FUSED_QUERIES = 128  # queries per block of SDPA's fused kernel (:func:`fused_here`; fewer calls beat smaller masks)


@dataclass(kw_only=True)
class Options:
    """``eval.remap_options``: the methods' parameters, None = the method's default (:func:`defaults`); a parameter of
    another method than ``eval.remap``'s is refused (:func:`check`). Keyword-only, so that :class:`Remap` adds its
    method first.

    sinks, recent: StreamingLLM's S start tokens and R recent tokens. n_local, n_global, d_max: LM-Infinite's local
    window, its global (starting) tokens and the distance the global ones are read at. window: ReRoPE's w, Leaky
    ReRoPE's w, Self-Extend's neighbour window W, DCA's local window w. leak: Leaky ReRoPE's k ≥ 1 (the slope past w is
    1/k). group: Self-Extend's group size G. chunk: DCA's chunk size c (its chunks of keys are s = c − w long).
    """

    sinks: Optional[int] = None
    recent: Optional[int] = None
    n_local: Optional[int] = None
    n_global: Optional[int] = None
    d_max: Optional[int] = None
    window: Optional[int] = None
    leak: Optional[float] = None
    group: Optional[int] = None
    chunk: Optional[int] = None


@dataclass(unsafe_hash=True)
class Remap(Options):
    """One method with its parameters (:class:`Options`'; see the module docstring; None where the method has no such
    parameter): ``Remap("self_extend", window=32, group=32)``. Hashed by its fields (:func:`fused_plan` keeps plans by
    it): not changed once built."""

    method: str

    def label(self) -> str:
        """``self_extend(W32,G32)``-like: the method and its parameters."""
        parts = ",".join(f"{'W' if self.method == 'self_extend' and p == 'window' else SHORT[p]}{getattr(self, p):g}"
                         for p in PARAMETERS[self.method])
        return f"{self.method}({parts})"

    def regions(self) -> int:
        """The number of regions: 3 for DCA, 2 for every other method."""
        return 3 if self.method == "dca" else 2

    def region_of(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """i: (Q, 1), j: (1, K) integer indices → (Q, K) int8: the region of each pair, −1 where the method hides the
        key or it comes after the query."""
        if self.method == "dca":  # 0 intra, 1 successive, 2 inter
            behind = torch.div(i, self.period, rounding_mode="floor") - torch.div(j, self.period, rounding_mode="floor")
            region = behind.clamp(-1, 2).to(torch.int8)  # (later chunks, −1 here, are masked below)
        else:
            d = i - j
            if self.method == "streaming":
                near, far = d <= self.recent, j < self.sinks
            elif self.method == "lm_infinite":
                near, far = d < self.n_local, j < self.n_global
            else:
                near, far = d < self.window, None
            region = (~near).to(torch.int8)  # 0 near, 1 far
            if far is not None:
                region.masked_fill_(~(near | far), -1)
        return region.masked_fill_(j > i, -1)

    def positions(self, region: int, T: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(P_q (T,), P_k (T,)) float64: the positions of queries i = 0 … T − 1 and keys j = 0 … T − 1 in ``region``."""
        n = torch.arange(T, device=device, dtype=torch.float64)
        m = self.method
        if m == "dca":
            s, within = self.period, torch.remainder(n, self.period)
            query = (within, (within + s).clamp(max=self.chunk), torch.full_like(n, min(2 * s - 1, self.chunk)))
            return query[region], within
        if region == 0:
            return n, n
        if m == "streaming":
            return n.clamp(max=self.sinks + self.recent), n
        if m == "lm_infinite":
            return torch.full_like(n, self.d_max), torch.zeros_like(n)
        if m == "rerope":
            return torch.full_like(n, self.window), torch.zeros_like(n)
        if m == "leaky_rerope":
            return self.window + (n - self.window) / self.leak, n / self.leak
        W, G = self.window, self.group  # self_extend
        return torch.floor(n / G) + W - W // G, torch.floor(n / G)

    def distance_index(self, region: int, T: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The distances of ``region`` re-indexed as one row per query: (o (T,) int64 ≥ 0, D (max(o) + T,) float64)
        with P_q(i) − P_k(j) = D[o(i) + j] for every pair (i, j) of the region (pairs outside it read anything).
        A bias of the distance alone is then D's bias at o(i) + j, so each query's row of bias is a slice of one vector,
        and queries whose o steps by 0 or −1 share a strided view of it (posbench/attention/blockwise.py's ``regions``).

        Per region, with s = c − w (DCA) and u = o(i) + j before o is shifted to start at 0:
        keys at j (every near region, StreamingLLM's sinks): o = −P_q(i), D(u) = −u; DCA's own chunk (i mod s −
        j mod s = i − j): o = −i, D(u) = −u;
        one distance c (ReRoPE's and LM-Infinite's far keys): o = 0, D(u) = c; Leaky ReRoPE's far keys: o = −i,
        D(u) = w + (−u − w)/k; Self-Extend's grouped keys at ⌊j/G⌋: o = −G·P_q(i), D(u) = −⌊u/G⌋; DCA's previous
        chunk (keys at j − s(⌊i/s⌋ − 1)): o = −P_q(i) − s(⌊i/s⌋ − 1), D(u) = −u; DCA's earlier chunks (keys at
        j mod s): o = 0, D(u) = P_q − (u mod s)."""
        qp, _ = self.positions(region, T, device)  # (T,) float64
        n, m = torch.arange(T, device=device, dtype=torch.float64), self.method
        if m == "dca" and region == 0:  # the same chunk: i mod s − j mod s = i − j
            o, distance = -n, lambda u: -u
        elif region == 0 or m == "streaming":
            o, distance = -qp, lambda u: -u
        elif m in ("rerope", "lm_infinite"):
            o, distance = torch.zeros_like(n), lambda u: torch.full_like(u, float(qp[0]))
        elif m == "leaky_rerope":
            o, distance = -n, lambda u: self.window + (-u - self.window) / self.leak
        elif m == "self_extend":
            o, distance = -self.group * qp, lambda u: -torch.floor(u / self.group)
        elif region == 1:  # dca, the previous chunk
            o, distance = -qp - self.period * (torch.floor(n / self.period) - 1), lambda u: -u
        else:  # dca, the chunks before it
            o, distance = torch.zeros_like(n), lambda u: qp[0] - torch.remainder(u, self.period)
        low = o.min()
        o = (o - low).long()
        return o, distance(torch.arange(int(o.max()) + T, device=device, dtype=torch.float64) + low)

    @property
    def period(self) -> int:
        """DCA's s = c − w: the length of its chunks of keys."""
        return self.chunk - self.window


def check(method: str, options, train_length: int, longest: int) -> None:
    """Fill the parameters of ``method`` left None in ``options`` (an :class:`Options`, or the config node holding its
    fields) with :func:`defaults`, and raise ValueError (``eval.remap_options.<name>=<value> …``) for a parameter of
    another method, a window, group, chunk or token count below 1 (sinks below 0), Leaky ReRoPE's k not above 1 or
    infinite and Self-Extend's G below 2 (each would be plain attention), Self-Extend's W not divisible by G (the
    reference's prefill and decoding then disagree), DCA's window not below its chunk, and a setting that shows every
    query every key at its own distance up to the longest evaluation length ``longest`` (the method would change
    nothing)."""
    own = PARAMETERS.get(method, ())
    for name in (f.name for f in fields(Options)):
        value = getattr(options, name)
        if value is not None and name not in own:
            raise ValueError(f"eval.remap_options.{name}={value} is not a parameter of eval.remap={method} "
                             f"({', '.join(own) or 'none'}): drop it")
    filled = defaults(method, train_length, longest) if any(getattr(options, n) is None for n in own) else {}
    for name in own:
        if getattr(options, name) is None:
            setattr(options, name, filled[name])
        value = getattr(options, name)
        low = {"sinks": 0, "group": 2}.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low \
                or name == "leak" and value == 1:
            raise ValueError(f"eval.remap_options.{name}={value!r} is not allowed: it must be a finite number "
                             f"{'> 1' if name == 'leak' else f'>= {low}'}")
        if name != "leak" and value != int(value):
            raise ValueError(f"eval.remap_options.{name}={value!r} is not allowed: it counts tokens, give an integer")
    o = options
    if method == "self_extend" and o.window % o.group:
        raise ValueError(f"eval.remap_options.window={o.window} is not divisible by eval.remap_options.group={o.group}: "
                         "Self-Extend's prefill and decoding agree only then; give a multiple of it")
    if method == "dca" and o.window >= o.chunk:
        raise ValueError(f"eval.remap_options.window={o.window} is not below eval.remap_options.chunk={o.chunk}: DCA's "
                         "chunks of keys are c − w long; give a smaller window")
    reach = {"streaming": ("recent", o.sinks + o.recent + 1 if method == "streaming" else 0),
             "lm_infinite": ("n_local", o.n_local), "rerope": ("window", o.window), "leaky_rerope": ("window", o.window),
             "self_extend": ("window", o.window), "dca": ("chunk", o.chunk - o.window if method == "dca" else 0)}
    if method in reach and reach[method][1] >= longest:
        name = reach[method][0]
        raise ValueError(f"eval.remap_options.{name}={getattr(o, name)} reaches the longest evaluation length {longest}: "
                         f"eval.remap={method} would change nothing; give a smaller one")


def of(method: str, options) -> Remap | None:
    """The :class:`Remap` of ``method`` with its (checked) parameters from ``options``; None for ``none``."""
    if method == "none":
        return None
    return Remap(method, **{name: getattr(options, name) for name in PARAMETERS[method]})


def defaults(method: str, train_length: int, longest: int) -> dict:
    """Each parameter's default for a model trained at L = ``train_length`` evaluated up to ``longest`` tokens, as the
    papers set them for their models: StreamingLLM's 4 start tokens and a cache of L (R = L − 1 − S: the query's
    farthest distance S + R stays below L); LM-Infinite's n_local = d_max = L and 10 global tokens; ReRoPE's
    w = L/8 (512 at 4096) and Leaky ReRoPE's k = 16; Self-Extend's smallest power of two G ≥ 2, with W the multiple of G
    nearest L/4 (1024 at 4096), that keeps every grouped position within L at ``longest`` (⌊(T − 1)/G⌋ + W − W/G ≤
    L − 1; ValueError where none does); DCA's c = 3L/4 and w = L/8 (ChunkLlama's ``chunk_size`` and
    ``local_window``)."""
    L = train_length
    if method == "streaming":
        return {"sinks": 4, "recent": L - 5}
    if method == "lm_infinite":
        return {"n_local": L, "n_global": 10, "d_max": L}
    if method in ("rerope", "leaky_rerope"):
        return {"window": max(1, L // 8), **({"leak": 16.0} if method == "leaky_rerope" else {})}
    if method == "dca":
        return {"chunk": max(2, 3 * L // 4), "window": max(1, L // 8)}
    if method == "self_extend":
        for G in (2 ** k for k in range(1, max(2, L).bit_length())):  # G = 2, 4, … below L
            W = G * max(1, round(L / 4 / G))  # the multiple of G nearest L/4
            if (longest - 1) // G + W - W // G <= L - 1:
                return {"window": W, "group": G}
        raise ValueError(f"eval.remap=self_extend has no default that keeps {longest} tokens within the train length "
                         f"L={L} (⌊(T − 1)/G⌋ + W − W/G ≤ L − 1 with W a multiple of G): give eval.remap_options.window "
                         "and eval.remap_options.group, or shorter lengths")
    return {}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scheme, prepared: Prepared,
           sink: torch.Tensor | None = None) -> torch.Tensor:
    """softmax over every region's scores (see the module docstring) · v, one block of :data:`QUERIES` queries at a
    time, each region's scores only over the keys its pairs span in the block; ``sink`` (H,) joins each denominator.
    The regions' scores merge by an elementwise maximum (each pair is in one region, −inf elsewhere) and the softmax
    runs in place, so a block holds two score buffers at most.

    On CPU in float32/float64 (``prepared.plan``) SDPA's fused kernel runs instead (posbench/attention/blockwise.py): for a bias
    of the distance alone, or none, one call per block with a float mask read from each region's bias vector
    (``regions``); for a rotary scheme, one call per region and piece of keys, merged by log-sum-exp (``rotated``).
    Everything else (a bias of i and j such as FIRE's, CUDA, bf16) runs the scores below.

    q, k, v: (B, H, T, Dh), q and k not rotated; ``prepared``: :func:`prepare`'s for this T → (B, H, T, Dh)."""
    if prepared.plan is not None and scheme.rotary:
        qs, ks = zip(*(scheme.rotate(q, k, t[1], t[2]) for t in prepared.tables))
        return blockwise.rotated(list(qs), list(ks), v, prepared.plan, sink)
    if prepared.plan is not None:
        return blockwise.regions(q, k, v, prepared.tables, prepared.plan, sink)
    B, H, T, Dh = q.shape
    dtype = torch.promote_types(q.dtype, torch.float32)
    scale = 1.0 / math.sqrt(Dh)
    turned = [_turn(scheme, q, k, t) for t in prepared.tables]  # per region: (q_r, k_r, bias_r or None)
    out = torch.empty_like(q)
    for s, e, parts in prepared.blocks:
        scores = torch.full((B, H, e - s, e), float("-inf"), dtype=dtype, device=q.device)
        for r, lo, hi, outside in parts:
            q_r, k_r, bias = turned[r]
            part = (q_r[:, :, s:e] @ k_r[:, :, lo:hi].transpose(-1, -2)).to(dtype).mul_(scale)  # (B, H, Q, hi − lo)
            if bias is not None:
                part += bias(s, e, lo, hi)
            view = scores[..., lo:hi]
            torch.maximum(view, part.masked_fill_(outside, float("-inf")), out=view)
            del part
        top = scores.amax(-1, keepdim=True)  # (B, H, Q, 1)
        if sink is not None:
            top = torch.maximum(top, sink.to(dtype)[None, :, None, None])
        total = scores.sub_(top).exp_().sum(-1, keepdim=True)
        if sink is not None:
            total += (sink.to(dtype)[None, :, None, None] - top).exp()
        out[:, :, s:e] = scores.div_(total).to(v.dtype) @ v[:, :, :e]
    return out


@dataclass
class Prepared:
    """What :func:`attend` needs for one window length, made once per forward pass and shared by the layers.

    tables: per region, ``("rotate", query tables, key tables)`` for a rotary scheme, ``("bias", P_q, P_k)`` for a bias
        scheme, None for a scheme that reads no position per pair; with ``plan`` and not rotary, the bias vector
        (H, U) of its distances (``Remap.distance_index``; zeros (1, U) for no bias).
    blocks: per block of queries [s, e): (s, e, [(region, lo, hi, the pairs among keys lo…hi − 1 *not* in it
        (e − s, hi − lo) bool), …]), each region that has pairs in the block.
    plan: on CPU in float32/float64 (:func:`fused_here`) for a rotary scheme, a bias of the distance alone or none:
        posbench/attention/blockwise.py's ``region_plan`` (then ``blocks`` is empty), else None.
    """

    tables: list
    blocks: list
    plan: list | None = None


def prepare(scheme, remap: Remap, T: int, dtype: torch.dtype, device) -> Prepared:
    """The :class:`Prepared` of ``scheme`` under ``remap`` for a window of T: each region's rotation tables
    (``scheme.rotation`` at its positions, one centre for the queries' and the keys'), bias positions or bias vector,
    and each block's regions and the keys they span (the fused kernels' plan, the same for every pass of one T, is
    kept: :func:`fused_plan`)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    fused = fused_here(dtype, device)
    if fused and not scheme.rotary and (not scheme.has_bias or scheme.distance_table or scheme.translation_invariant):
        plan, distances = fused_plan(remap, T, device, True, FUSED_QUERIES)
        zero = torch.zeros(1, dtype=torch.long, device=device)
        vectors = [scheme.pair_bias(_integral(D), zero, dtype)[:, :, 0].detach().to(dtype).contiguous()
                   if scheme.has_bias else torch.zeros(1, D.numel(), dtype=dtype, device=device)
                   for D in distances]  # (H, U_r) each (no gradient: an evaluation); no bias: zeros
        return Prepared(vectors, [], plan)
    tables = []
    for r in range(remap.regions()):
        qp, kp = remap.positions(r, T, device)
        if scheme.rotary:
            both = torch.cat((qp, kp))
            centre = float(both.min() + both.max()) / 2
            tables.append(("rotate", scheme.rotation(qp, dtype, centre), scheme.rotation(kp, dtype, centre)))
        elif scheme.has_bias:
            tables.append(("bias", _integral(qp), _integral(kp)))
        else:
            tables.append(None)
    if fused and scheme.rotary:
        return Prepared(tables, [], fused_plan(remap, T, device, False, FUSED_QUERIES)[0])
    blocks = []
    for s, e, region in _region_blocks(remap, T, QUERIES, device):
        parts = []
        for r in range(remap.regions()):
            keys = (region == r).any(0).nonzero()
            if keys.numel():
                lo, hi = int(keys[0]), int(keys[-1]) + 1
                parts.append((r, lo, hi, region[:, lo:hi] != r))
        blocks.append((s, e, parts))
    return Prepared(tables, blocks)


@functools.lru_cache(maxsize=16)
def fused_plan(remap: Remap, T: int, device: torch.device, offsets: bool, Q: int) -> tuple[list, list]:
    """posbench/attention/blockwise.py's ``region_plan`` of ``remap`` at T in blocks of Q queries, with each region's
    offsets and distances D (``Remap.distance_index``) where ``offsets`` (for ``regions``; ``rotated`` needs none):
    (plan, [D per region] or []). A function of its arguments alone, so kept for the next pass of the same T
    (an evaluation scores many batches at each length)."""
    index = [remap.distance_index(r, T, device) for r in range(remap.regions())] if offsets else []
    plan = blockwise.region_plan(_region_blocks(remap, T, Q, device), remap.regions(),
                                 [o for o, _ in index] if offsets else None)
    return plan, [D for _, D in index]


def _region_blocks(remap: Remap, T: int, Q: int, device: torch.device):
    """(s, e, each pair's region (e − s, e) int8) per block of Q queries [s, e)."""
    for s in range(0, T, Q):
        e = min(T, s + Q)
        yield s, e, remap.region_of(torch.arange(s, e, device=device, dtype=torch.int32)[:, None],
                                    torch.arange(e, device=device, dtype=torch.int32)[None])


def fused_here(dtype: torch.dtype, device) -> bool:
    """Whether :func:`attend` runs SDPA's fused CPU kernel per block (posbench/attention/blockwise.py's ``regions`` for a bias of
    the distance alone or none, ``rotated`` for a rotary scheme): on CPU, in float32 or float64, where torch has it."""
    return device.type == "cpu" and dtype in (torch.float32, torch.float64) and blockwise.flash_cpu is not None


def _integral(p: torch.Tensor) -> torch.Tensor:
    """Positions as int64 where they are whole (every bias reads those), else float64 (Leaky ReRoPE's)."""
    return p.long() if bool((p == p.floor()).all()) else p


def _turn(scheme, q, k, table):
    """(q_r, k_r, bias_r) of one region: q and k turned by its tables, or as they are with its bias function."""
    if table is None:
        return q, k, None
    if table[0] == "rotate":
        q_r, k_r = scheme.rotate(q, k, table[1], table[2])
        return q_r, k_r, None
    qp, kp, dtype = table[1], table[2], torch.promote_types(q.dtype, torch.float32)
    return q, k, lambda s, e, lo, hi: scheme.pair_bias(qp[s:e], kp[lo:hi], dtype)  # (H, Q, hi − lo)
