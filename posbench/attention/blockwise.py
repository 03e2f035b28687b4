"""Causal attention with a bias through SDPA's fused kernels, one block of queries at a time, and the bias blocks:
the ``folded`` and ``banded`` kernels of posbench/attention/dispatch.py, the ``regions`` and ``rotated`` kernels of
posbench/attention/remap.py, and the per-distance table and dense mask they share. ``folded`` and ``banded`` take the attention
module's context (``ctx``) as built for them, ``regions`` and ``rotated`` a plan (:func:`region_plan`); each returns
softmax(q·kᵀ/√Dh + bias, later keys masked) · v, q, k, v (B, H, T, Dh) → (B, H, T, Dh).

* ``folded`` — a key-only bias (ALiBi). Softmax ignores a term constant across a query's row, so Press et al. 2022
  (§3)'s −m·(i − j) may be replaced by the key-only −m·(c − j) for a reference position c, which is one extra head
  dimension: q' = (q/√Dh, 1), k' = (k, bias(c, j)), v' = (v, 0) at scale 1 give q·k/√Dh + bias(c, j) in SDPA's
  fused kernels. Queries go in blocks of :data:`FOLD_QUERIES`, c the middle of each, so the folded bias of the keys
  a query attends to stays small (fp32 keeps ~1e-6, where one c for 8192 positions loses ~1e-4). A window of one
  block runs causal SDPA; without gradients a longer one runs, per block, a causal diagonal square and the unmasked
  keys before it, merged by their log-sum-exps (the square's weight is σ(lse_square − lse_past)); with gradients,
  each block against all its keys with a causal float mask.
* ``banded`` — a bias of the distance alone, from its table per distance (H, N), without gradients. A
  ``far_constant`` bias (T5 past ``max_distance``) is the same constant c_h for every distance from D on. Per block of
  :data:`FOLD_QUERIES` queries [s, e), the keys j ≤ s − D all carry c_h: one unmasked SDPA over them, whose
  log-sum-exp takes + c_h. The keys after them carry the table's bias, indexed by i − j, and the causal mask: one
  SDPA with a float mask of (H, e − s, e − s + D − 1). Both are merged by their log-sum-exps, as in ``folded``. With
  positions 0…T−1 plus an offset, every block's mask is a slice of one (H, Q, Q + D − 1) pattern built once per
  forward pass (:func:`banded_pattern`: a sliding view, no copy); other increasing positions build each block's mask.
  With a window (posbench/attention/windows.py) a block attends to the keys from the window's first one on, the rest never
  touched: a sliding window of W over consecutive positions is the table's bias below distance W and −inf from W on
  (:func:`windowed_table`), so the pattern serves it; other positions build each block's mask with the window's.
  Without a far part it takes gradients too: SDPA with the same float mask.

* ``regions`` — an evaluation's remap (posbench/attention/remap.py) of a bias of the distance alone, without gradients: each
  region's distances re-indexed as one vector per region (``Remap.distance_index``: query i reads D[o(i) + j]), its
  bias a vector (H, U) built once per forward pass. Per block of queries (rows reversed, as in ``banded``), the keys
  some query sees (a method's hidden middle skipped), one float mask, and one fused SDPA: keys where every query of
  the block is in one region copy that region's bias as strided views (a run of queries whose o steps by 0 or 1 is
  one view), the few keys with a mix of regions (near the diagonal and the regions' borders) select per pair.
* ``rotated`` — the same remap of a rotary scheme, without gradients: q and k turned by each region's positions,
  one fused SDPA per region and piece of keys of a block (unmasked where every query is in the region, a 0/−inf mask
  where regions mix), merged by their log-sum-exps.

All take a learned sink logit per head (GPT-OSS): without gradients the block's output times σ(lse − sink), with
them the sink as one more key (:func:`with_sink`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from posbench.attention.windows import Window
from posbench.schemes.base import PositionalScheme

FOLD_QUERIES = 256  # folded and banded: queries per block; |query − c| ≤ 128 positions keeps the fp32 bias error ≲ 4e-6
# SDPA's fused CPU kernel, which also returns each query's log-sum-exp (B, H, Tq); no gradient flows through
# the log-sum-exp, so it serves evaluation only. A private ATen op (torch ≥ 2.2): None where it is missing.
flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def fused_cpu(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether SDPA's fused CPU kernel (:data:`flash_cpu`) can run here: on CPU, activations in float32 or float64
    (an 8-bit mantissa would round a bias that the kernels fold or slide), where torch has it. The one predicate of
    the kernel choice (posbench/attention/choice.py) and of the remap kernels (posbench/attention/remap_kernel.py)."""
    return device.type == "cpu" and dtype in (torch.float32, torch.float64) and flash_cpu is not None


def distances(table: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """i − j of broadcastable int positions, future keys (negative) as 0: the table's column (the mask hides them)."""
    return (q_pos - k_pos).clamp(0, table.shape[-1] - 1)


def distance_table(scheme: PositionalScheme, pos: torch.Tensor, dtype: torch.dtype,
                   span: int | None = None) -> torch.Tensor:
    """The bias of a ``distance_table`` scheme (or of FIRE over a window within its threshold) at every distance n =
    0…N−1 a window at positions ``pos`` (T,) int64 holds, N = ``span`` or max(pos) − min(pos) + 1:
    ``scheme.pair_bias`` of queries at n against a key at 0 → (H, N), in ``dtype`` or float32 if wider (its
    gradient reaches the scheme's parameters through autograd, outside any kernel)."""
    n = torch.arange(span or int(pos.max() - pos.min()) + 1, device=pos.device)  # (N,)
    return scheme.pair_bias(n, n[:1], torch.promote_types(dtype, torch.float32))[:, :, 0]  # (H, N)


def dense_mask(scheme: PositionalScheme, pos: torch.Tensor, n_head: int, s: int, e: int,
               dtype: torch.dtype, table: torch.Tensor | None = None, a: int = 0,
               window: Window | None = None) -> torch.Tensor:
    """Bias plus causal mask of queries s…e−1 against keys a…e−1: (H, e − s, e − a) in ``dtype``, −inf where the
    key comes after the query (by index) or lies outside its ``window``. The bias is ``scheme.pair_bias`` of those
    positions, or a per-distance ``table`` (H, N) indexed by i − j (a ``distance_table`` scheme's
    :func:`distance_table`, built here if not given)."""
    if table is not None or scheme.distance_table:
        table = distance_table(scheme, pos, dtype) if table is None else table  # (H, N)
        bias = table[:, distances(table, pos[s:e, None], pos[None, a:e])]  # (H, e-s, e-a)
    else:
        bias = scheme.pair_bias(pos[s:e], pos[a:e], dtype)  # (H, e-s, e-a)
    i, j = torch.arange(s, e, device=pos.device)[:, None], torch.arange(a, e, device=pos.device)[None, :]
    hidden = j > i if window is None else ~window.visible(i, j)  # (e-s, e-a)
    return bias.masked_fill(hidden, float("-inf")).to(dtype).expand(n_head, e - s, e - a)


def windowed_table(table: torch.Tensor, W: int) -> torch.Tensor:
    """A per-distance table (H, N) with a sliding window of W folded in: its bias below distance W, −inf from W on (a
    new tensor; gradients reach ``table``)."""
    far = torch.arange(table.shape[-1], device=table.device) >= W  # (N,)
    return table.masked_fill(far, float("-inf"))


def sunk(y: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Attention output y (B, H, Q, Dh) of keys whose scores have log-sum-exp ``lse`` (B, H, Q), with a sink logit s_h
    (H,) joined to each softmax: y·Z/(Z + e^s) = y·σ(lse − s)."""
    return y * torch.sigmoid(lse - sink[:, None].to(lse.dtype))[..., None].to(y.dtype)


def with_sink(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor):
    """One block's keys, values and float mask with a sink in front: key and value zero, the mask's column the sink
    logit of each head, so that SDPA's softmax takes exp(sink_h) into every query's denominator and its output nothing
    from it. k, v: (B, H, K, Dh), mask: (H or 1, Q, K), sink: (H,) → (B, H, K + 1, Dh) twice and (H, Q, K + 1)."""
    H, Q = sink.shape[0], mask.shape[-2]
    column = sink.to(mask.dtype)[:, None, None].expand(H, Q, 1)
    return (F.pad(k, (0, 0, 1, 0)), F.pad(v, (0, 0, 1, 0)),
            torch.cat((column, mask.expand(H, Q, mask.shape[-1])), dim=-1))


# ---- folded: a key-only bias as one extra head dimension -------------------------------------------------


def folded(q, k, v, ctx) -> torch.Tensor:
    """Per query block [s, e) with reference c: keys 0…e−1 carry bias(c, j) in the extra dimension."""
    B, H, T, Dh = q.shape
    qf = F.pad(q * (1.0 / math.sqrt(Dh)), (0, 1), value=1.0)  # (B, H, T, Dh+1): (q/√Dh, 1)
    vf = F.pad(v, (0, 1))  # (B, H, T, Dh+1): the fused CPU kernel needs one width for q, k and v
    if len(ctx.blocks) == 1:
        kf = torch.cat((k, ctx.key_bias[0].expand(B, H, T)[..., None]), dim=-1)  # (B, H, T, Dh+1)
        return F.scaled_dot_product_attention(qf, kf, vf, dropout_p=ctx.dropout, is_causal=True, scale=1.0)[..., :Dh]
    if ctx.fold_mask is None:  # no gradients, no dropout: diagonal square (causal) + the keys before it, merged
        kf = F.pad(k, (0, 1))  # (B, H, T, Dh+1); the last column is rewritten for each block's reference
        y = torch.empty_like(qf)  # (B, H, T, Dh+1)
        for (s, e), bias in zip(ctx.blocks, ctx.key_bias):
            kf[:, :, :e, Dh] = bias  # (H, e) into (B, H, e)
            y_diag, lse_diag = flash_cpu(qf[:, :, s:e], kf[:, :, s:e], vf[:, :, s:e], 0.0, True, scale=1.0)
            if s:  # weight of the square = Z_diag / (Z_diag + Z_past) = sigmoid(lse_diag − lse_past), (B, H, e-s)
                y_past, lse_past = flash_cpu(qf[:, :, s:e], kf[:, :, :s], vf[:, :, :s], 0.0, False, scale=1.0)
                y_diag = torch.lerp(y_past, y_diag, torch.sigmoid(lse_diag - lse_past)[..., None])
            y[:, :, s:e] = y_diag  # (B, H, e-s, Dh+1)
        return y[..., :Dh]  # (B, H, T, Dh)
    out = []
    for (s, e), bias in zip(ctx.blocks, ctx.key_bias):  # differentiable: each block against keys 0…e−1, masked
        kf = torch.cat((k[:, :, :e], bias.expand(B, H, e)[..., None]), dim=-1)  # (B, H, e, Dh+1)
        mask = ctx.fold_mask[: e - s, T - s: T + e - s]  # (e-s, e): 0 before key s, causal from s on
        out.append(F.scaled_dot_product_attention(qf[:, :, s:e], kf, vf[:, :, :e], attn_mask=mask,
                                                  dropout_p=ctx.dropout, scale=1.0))  # (B, H, e-s, Dh+1)
    return torch.cat(out, dim=2)[..., :Dh]  # (B, H, T, Dh)


# ---- banded: a bias of i − j alone, a sliding mask per query block (T5: its far keys unmasked) ---------------------


def banded_pattern(table: torch.Tensor, Q: int, D: int, dtype: torch.dtype) -> torch.Tensor:
    """The near keys' bias and causal mask of a query block at positions 0…T−1 plus an offset, rows reversed, as a
    view of one (H, 2Q + D − 2) tensor: (H, Q, Q + D − 1), row Q − 1 − r (query s + r) against column c (key
    s − D + 1 + c) holding the bias of distance r + D − 1 − c, −inf for a later key. (Reversed rows make it a
    sliding window, ``unfold``, with no copy.)"""
    x = torch.arange(-(Q - 1), D, device=table.device)  # c − r of the rows and columns
    near = table[:, (D - 1 - x).clamp(0, table.shape[-1] - 1)].to(dtype)  # (H, Q + D - 1)
    later = torch.full((table.shape[0], Q - 1), float("-inf"), dtype=dtype, device=table.device)  # c − r ≥ D
    return torch.cat((near, later), dim=1).unfold(1, Q + D - 1, 1)  # (H, Q, Q + D - 1)


def banded(q, k, v, ctx, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Per query block [s, e): the near keys (the table's bias, causal; a window's from its first key) and, for a
    far_constant scheme without a window, the far keys 0…s − D (bias c_h, unmasked), merged by their log-sum-exps
    (:func:`folded`'s merge). With gradients on (a window, or no far keys): SDPA with the block's float mask. A sink
    (H,) scales each block by σ(lse − sink) without gradients, and is one more key with them (:func:`with_sink`)."""
    D, H, window = ctx.far, q.shape[1], ctx.window
    grad = torch.is_grad_enabled()
    out = []
    for s, e in ctx.blocks:
        a = window.first_key(s) if window is not None else max(0, s - D + 1)  # the first near key
        if ctx.masks:  # the pattern's rows reversed: the block's queries go in reversed, come out reversed back
            Q, first = ctx.masks[0].shape[1], a - (s - D + 1)  # key j is column j − (s − D + 1)
            mask, qb = ctx.masks[0][:, Q - (e - s):, first: first + e - a], q[:, :, s:e].flip(2)  # (H, e-s, e-a)
        else:
            mask, qb = dense_mask(ctx.scheme, ctx.pos, H, s, e, q.dtype, ctx.table, a, window), q[:, :, s:e]
        kb, vb = k[:, :, a:e], v[:, :, a:e]
        if grad:  # no far keys here (posbench/attention/dispatch.py chooses banded with gradients only then)
            if sink is not None:
                kb, vb, mask = with_sink(kb, vb, mask, sink)
            yb = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask.to(q.dtype)[None])  # (B, H, e-s, Dh)
            out.append(yb.flip(2) if ctx.masks else yb)
            continue
        yb, lse = flash_cpu(qb, kb, vb, 0.0, False, attn_mask=mask[None])  # (B, H, e-s, Dh), (B, H, e-s)
        if a and window is None and ctx.far_bias is not None:  # the far keys: weight of the near ones
            y_far, lse_far = flash_cpu(qb, k[:, :, :a], v[:, :, :a], 0.0, False)  # (B, H, e-s, Dh), (B, H, e-s)
            c = ctx.far_bias[:, None].to(lse.dtype)  # (H, 1)
            w = torch.sigmoid(lse - lse_far - c)  # (B, H, e-s)
            yb = torch.lerp(y_far, yb, w[..., None].to(yb.dtype))
            if sink is not None:
                lse = torch.logaddexp(lse, lse_far + c)  # the log-sum-exp of near and far keys
        if sink is not None:
            yb = sunk(yb, lse, sink)
        out.append(yb.flip(2) if ctx.masks else yb)
    return torch.cat(out, dim=2)  # (B, H, T, Dh)


# ---- regions: a bias of the distance alone read at a remap's distances (posbench/attention/remap.py) ----------------------


@dataclass
class RegionBlock:
    """One block of queries [s, e) of :func:`regions` and :func:`rotated`, its rows reversed (as
    :func:`banded_pattern`'s).

    keys: the intervals [a, b) of keys some query of the block sees, in order; the mask's columns are them joined.
    pieces: (region, j0, j1, column, inside, hidden): keys j0 … j1 − 1 of one interval, at the mask's columns from
        ``column``, where every query of the block is in ``region`` (inside and hidden None), or a mix (region −1;
        inside: per region with pairs there, (region, its pairs (e − s, j1 − j0) bool, rows reversed); hidden: the
        pairs of none).
    runs: per region, the rows as runs (t0, t1, o at row t0, step): rows t0 … t1 − 1 read the region's bias vector
        from o + step·(t − t0) + j, step 0 or 1 (:func:`regions`; empty for :func:`rotated`).
    """

    s: int
    e: int
    keys: list
    pieces: list
    runs: list
    masks: dict = field(default_factory=dict, repr=False)  # (piece, region, dtype) → :meth:`piece_mask`'s

    def piece_mask(self, piece: int, region: int, pairs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Region ``region``'s float mask over mixed piece ``piece`` (1, 1, e − s, j1 − j0): 0 at its ``pairs``, −inf
        elsewhere; and the block's queries with none of those pairs (e − s,) bool. Made once per dtype and kept with
        the plan (:func:`rotated` runs every layer and pass of one window length on it)."""
        key = (piece, region, dtype)
        if key not in self.masks:
            mask = torch.zeros(pairs.shape, dtype=dtype, device=pairs.device).masked_fill_(~pairs, float("-inf"))
            self.masks[key] = (mask[None, None], ~pairs.any(1))
        return self.masks[key]


def region_plan(region_blocks, regions: int, offsets: list[torch.Tensor] | None = None) -> list[RegionBlock]:
    """The :class:`RegionBlock` of each block of queries: ``region_blocks`` an iterable of (s, e, regions (e − s, e)
    int8: each pair's region 0 … ``regions`` − 1, −1 where hidden or later); ``offsets`` for :func:`regions`, per
    region o (T,) int64 (``Remap.distance_index``: query i reads its region's bias vector at o(i) + j), None for
    :func:`rotated`."""
    plan = []
    for s, e, region in region_blocks:
        region = region.flip(0)  # rows reversed: query e − 1 first
        same = (region == region[:1]).all(0)  # (e,): one region for every query of the block
        kind = torch.where(same, region[0], -2)  # region, −1 hidden, −2 mixed
        values, counts = torch.unique_consecutive(kind, return_counts=True)
        keys, pieces, j0, column = [], [], 0, 0
        for value, count in zip(values.tolist(), counts.tolist()):
            j1 = j0 + count
            if value != -1:
                if keys and keys[-1][1] == j0:
                    keys[-1] = (keys[-1][0], j1)
                else:
                    keys.append((j0, j1))
                part = region[:, j0:j1]  # (e-s, j1-j0)
                inside = [(r, pairs) for r in range(regions) if (pairs := part == r).any()] if value == -2 else None
                pieces.append((max(value, -1), j0, j1, column, inside, part < 0 if value == -2 else None))
                column += count
            j0 = j1
        plan.append(RegionBlock(s, e, keys, pieces, [_runs(o[s:e].flip(0).tolist()) for o in offsets or []]))
    return plan


def _runs(o: list[int]) -> list[tuple[int, int, int, int]]:
    """Rows 0 … len(o) − 1 reading from o[t] as maximal runs (t0, t1, o[t0], step), o[t] = o[t0] + step·(t − t0)
    within a run, step 0 or 1 (a lone row: 0)."""
    runs, t0 = [], 0
    while t0 < len(o):
        step = o[t0 + 1] - o[t0] if t0 + 1 < len(o) and o[t0 + 1] - o[t0] in (0, 1) else 0
        t1 = t0 + 1
        while t1 < len(o) and o[t1] - o[t1 - 1] == step:
            t1 += 1
        runs.append((t0, t1, o[t0], step))
        t0 = t1
    return runs


def _read(out: torch.Tensor, vector: torch.Tensor, runs: list, j0: int, j1: int) -> None:
    """Into ``out`` (H, Q, j1 − j0): row t, column j − j0 ← vector[:, o(t) + j], one strided view per run of rows."""
    H = vector.shape[0]
    for t0, t1, o0, step in runs:
        out[:, t0:t1].copy_(vector.as_strided((H, t1 - t0, j1 - j0), (vector.stride(0), step, 1),
                                              vector.storage_offset() + o0 + j0))


def regions(q, k, v, vectors: list[torch.Tensor], plan: list[RegionBlock],
            sink: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ/√Dh + each pair's region's bias, hidden pairs masked) · v without gradients, one SDPA per block of
    queries with a float mask of the keys it sees: region r's pairs read its bias vector ``vectors[r]`` (H, U_r),
    contiguous, at o_r(i) + j (``Remap.distance_index``); ``plan``: :func:`region_plan`'s; ``sink`` (H,) joins each
    denominator (:func:`sunk`). q, k, v: (B, H, T, Dh) in float32 or float64 → (B, H, T, Dh)."""
    H = q.shape[1]
    out = torch.empty_like(q)
    sizes = [(block.e - block.s) * sum(b - a for a, b in block.keys) for block in plan]
    work = torch.empty(H, max(sizes), dtype=q.dtype, device=q.device)  # one buffer: fresh pages per block cost more
    for block, size in zip(plan, sizes):
        s, e = block.s, block.e
        mask = work[:, :size].view(H, e - s, -1)  # (H, e-s, K) contiguous per head
        for region, j0, j1, column, inside, hidden in block.pieces:
            view = mask[..., column: column + j1 - j0]  # (H, e-s, j1-j0)
            if inside is None:
                _read(view, vectors[region], block.runs[region], j0, j1)
                continue
            (first, _), *others = inside
            _read(view, vectors[first], block.runs[first], j0, j1)
            part = torch.empty_like(view) if others else None
            for r, pairs in others:
                _read(part, vectors[r], block.runs[r], j0, j1)
                torch.where(pairs, part, view, out=view)
            view.masked_fill_(hidden, float("-inf"))
        kb, vb = (x[:, :, block.keys[0][0]: block.keys[0][1]] if len(block.keys) == 1 else
                  torch.cat([x[:, :, a:b] for a, b in block.keys], dim=2) for x in (k, v))  # (B, H, K, Dh)
        yb, lse = flash_cpu(q[:, :, s:e].flip(2), kb, vb, 0.0, False, attn_mask=mask[None])  # (B, H, e-s, Dh)
        out[:, :, s:e] = (sunk(yb, lse, sink) if sink is not None else yb).flip(2)
    return out


def rotated(qs: list[torch.Tensor], ks: list[torch.Tensor], v: torch.Tensor, plan: list[RegionBlock],
            sink: torch.Tensor | None = None) -> torch.Tensor:
    """softmax over every region's q_r·k_rᵀ/√Dh (hidden pairs masked) · v without gradients: per block of queries,
    one fused SDPA per piece of keys and region in it (unmasked where every query of the block is in the region, a
    float mask where regions mix), all merged by their log-sum-exps; ``sink`` (H,) joins each denominator.
    qs, ks: per region, q and k turned by its positions, (B, H, T, Dh) in float32 or float64; v: (B, H, T, Dh);
    ``plan``: :func:`region_plan`'s → (B, H, T, Dh)."""
    out = torch.empty_like(v)
    for block in plan:
        s, e = block.s, block.e
        queries, ys, lses = {}, [], []  # per region the block has: its queries, rows reversed as the plan's
        for piece, (region, j0, j1, _, inside, _) in enumerate(block.pieces):
            for r, pairs in inside or [(region, None)]:
                if r not in queries:
                    queries[r] = qs[r][:, :, s:e].flip(2)  # (B, H, e-s, Dh)
                mask, empty = block.piece_mask(piece, r, pairs, v.dtype) if pairs is not None else (None, None)
                y, lse = flash_cpu(queries[r], ks[r][:, :, j0:j1], v[:, :, j0:j1], 0.0, False, attn_mask=mask)
                if pairs is not None:  # a query with no key here (empty): lse −inf and y 0 for the merge (SDPA leaves
                    lse, y = lse.masked_fill(empty, float("-inf")), y.masked_fill(empty[:, None], 0.0)  # them undefined)
                ys.append(y)
                lses.append(lse)  # (B, H, e-s)
        lse = torch.logsumexp(torch.stack(lses), 0)  # (B, H, e-s)
        y = sum(yi * (li - lse).exp()[..., None].to(yi.dtype) for yi, li in zip(ys, lses))  # (B, H, e-s, Dh)
        out[:, :, s:e] = (sunk(y, lse, sink) if sink is not None else y).flip(2)
    return out
