"""Training-free extension at evaluation (``eval.remap``): the methods deployed RoPE models use to run past their
training length, each keeping every distance a model reads within what it trained on.

Each method splits the causal pairs (query i, key j ≤ i; d = i − j; indices in the evaluation window) into regions,
the pairs it hides in none, and scores region r at remapped positions (P_q^r(i), P_k^r(j)) — each a function of i or
of j alone. The softmax runs once over every region's scores (posbench/attention/remap_kernel.py), so a query's
attention is exactly
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
    model.remap = remap     # posbench/model/gpt.py: every layer's attention then runs remap_kernel.attend
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch

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
    parameter): ``Remap("self_extend", window=32, group=32)``. Hashed by its fields (``remap_kernel.fused_plan`` keeps plans by
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

    def key_span(self, region: int, s: int, e: int) -> tuple[int, int]:
        """[lo, hi): the keys from the first to the last that queries s … e − 1 see in ``region`` (hi ≤ lo: none),
        from the region's bounds in i − j and j as :meth:`region_of` draws them, without reading any tensor."""
        m = self.method
        if m == "dca":  # chunks of p = c − w keys: intra ⌊j/p⌋ = ⌊i/p⌋, successive one chunk behind, inter two or more
            p = int(self.period)
            first, last = s // p, (e - 1) // p
            return ((first * p, e), ((max(first, 1) - 1) * p, last * p), (0, (last - 1) * p))[region]
        near, sinks = (self.recent + 1, self.sinks) if m == "streaming" else (self.n_local, self.n_global) \
            if m == "lm_infinite" else (self.window, e)  # near: i − j < near; far: j < sinks and i − j ≥ near
        if region == 0:
            return max(0, s - int(near) + 1), e
        return 0, min(int(sinks), e - int(near))

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
