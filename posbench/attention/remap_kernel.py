"""The remap kernel: an evaluation's training-free extension (posbench/attention/remap.py's methods) run as attention.

:func:`prepare` makes, once per forward pass, each region's rotation tables (a rotary scheme), bias positions or bias
vectors (a bias scheme) and each block's regions; :func:`attend` then runs every layer: one softmax over every
region's scores. On CPU in float32/float64 SDPA's fused kernel runs per block (posbench/attention/blockwise.py's
``regions`` and ``rotated``, on a plan kept per window length: :func:`fused_plan`); otherwise plain tensor operations.

    prepared = prepare(scheme, Remap("self_extend", window=32, group=32), T, torch.float32, "cpu")
    y = attend(q, k, v, scheme, prepared)   # q, k unrotated, v: (B, H, T, Dh) → (B, H, T, Dh)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from posbench.attention import blockwise
from posbench.attention.remap import Remap

QUERIES = 64  # queries per block of :func:`attend`'s scores
FUSED_QUERIES = 128  # queries per block of SDPA's fused kernel (``blockwise.fused_cpu``; fewer calls beat smaller masks)


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
    plan: on CPU in float32/float64 (``blockwise.fused_cpu``) for a rotary scheme, a bias of the distance alone or none:
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
    fused = blockwise.fused_cpu(dtype, device)
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
    blocks = []  # each region's keys in a block from Remap.key_span: no host sync per block (on CUDA)
    for s, e, region in _region_blocks(remap, T, QUERIES, device):
        spans = [(r, remap.key_span(r, s, e)) for r in range(remap.regions())]
        blocks.append((s, e, [(r, lo, hi, region[:, lo:hi] != r) for r, (lo, hi) in spans if lo < hi]))
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
