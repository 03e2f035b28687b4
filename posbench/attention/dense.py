"""The attention kernels in plain tensor operations, one block of queries at a time: ``dense`` (a bias plus the causal
mask as SDPA's float mask, per block of queries against the keys its window shows) and ``contextual`` (a bias the
scheme computes from the queries and their scores: CoPE). posbench/attention/choice.py says when each runs;
posbench/attention/dispatch.py calls them with the context it built.

    y = dense(q, k, v, ctx)           # q, k, v: (B, H, T, Dh) → (B, H, T, Dh)
    y = contextual(q, k, v, ctx, sink)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from posbench.attention import blockwise
from posbench.attention.blockwise import with_sink
from posbench.attention.windows import Window

BIAS_ELEMENTS = 1 << 24  # dense: largest bias block (H · queries · keys floats) built at once, 64 MiB in fp32
CONTEXT_ELEMENTS = 1 << 22  # contextual: largest block of scores (B · H · queries · keys) per step, 16 MiB in fp32
CONTEXT_ELEMENTS_CUDA = 1 << 26  # the same on a GPU, 256 MiB: blocks of a CPU's size leave a GPU launch-bound
WINDOW_QUERIES = 64  # a windowed layer's blocks: queries per block, each against its block and the W − 1 keys before it


def first_key(window: Window | None, s: int) -> int:
    """The first key a query block starting at ``s`` attends to: 0 without a window."""
    return 0 if window is None else window.first_key(s)



def dense_blocks(T: int, n_head: int, window: Window | None = None) -> list[tuple[int, int]]:
    """Query blocks (start, end) whose bias (H, end − start, keys) fits in :data:`BIAS_ELEMENTS`: keys ≤ T, or with a
    window the block's own and the W − 1 before (:func:`window_blocks`)."""
    if window is None:
        per_block = max(1, BIAS_ELEMENTS // (n_head * T))
        return [(s, min(T, s + per_block)) for s in range(0, T, per_block)]
    return window_blocks(T, window, lambda keys: BIAS_ELEMENTS // (n_head * keys))


def window_blocks(T: int, window: Window, fit) -> list[tuple[int, int]]:
    """Query blocks (start, end) of a windowed layer: max(W, :data:`WINDOW_QUERIES`) queries, fewer where ``fit(keys)``
    (the most queries whose block against ``keys`` keys fits a kernel's budget) says so, so that a block's keys, its
    own and the W − 1 before, stay few whatever T; a chunked window's blocks end at its chunks' ends, so that a block
    sees keys of one chunk."""
    Q = max(window.size, WINDOW_QUERIES)
    Q = max(1, min(Q, fit(Q + window.size - 1)))
    if window.kind == "sliding":
        return [(s, min(T, s + Q)) for s in range(0, T, Q)]
    C = window.size
    return [(s, min(T, c + C, s + Q)) for c in range(0, T, C) for s in range(c, min(T, c + C), Q)]


def dense(q, k, v, ctx, sink: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA with a float mask per query block against the keys its window shows (all earlier ones without a window):
    the context's masks, or each block's built here; a sink as one more key (:func:`~posbench.attention.blockwise.with_sink`)."""
    H, T = q.shape[1], q.shape[2]
    out = []
    for i, (s, e) in enumerate(ctx.blocks if ctx.kernel == "dense" else dense_blocks(T, H, ctx.window)):
        a = first_key(ctx.window, s)
        table = ctx.table if ctx.table is not None and ctx.table.dim() == 2 else None  # (not a flex (H, T, T) bias)
        mask = ctx.masks[i] if ctx.masks else blockwise.dense_mask(ctx.scheme, ctx.pos, H, s, e, q.dtype, table, a, ctx.window)
        kb, vb, mask = k[:, :, a:e], v[:, :, a:e], mask.to(q.dtype)  # (B, H, e-a, Dh) each, (H, e-s, e-a)
        if sink is not None:
            kb, vb, mask = with_sink(kb, vb, mask, sink)
        out.append(F.scaled_dot_product_attention(q[:, :, s:e], kb, vb, dropout_p=ctx.dropout,
                                                  attn_mask=mask[None]))  # (B, H, e-s, Dh)
        # (a 4-D mask: SDPA's fused CPU kernel refuses a 3-D one and falls back to materialising the scores)
    return torch.cat(out, dim=2)  # (B, H, T, Dh)


# ---- contextual: a bias the scheme computes from the queries and their scores, one block of queries at a time -----


def contextual_blocks(B: int, H: int, T: int, device: str = "cpu", window: Window | None = None) -> list[tuple[int, int]]:
    """Query blocks (start, end) whose scores (B, H, end − start, keys ≤ T) fit in :data:`CONTEXT_ELEMENTS`
    (:data:`CONTEXT_ELEMENTS_CUDA` when ``device`` is ``cuda``); with a window, :func:`window_blocks`."""
    budget = CONTEXT_ELEMENTS_CUDA if device == "cuda" else CONTEXT_ELEMENTS
    if window is not None:
        return window_blocks(T, window, lambda keys: budget // (B * H * keys))
    per_block = max(1, budget // (B * H * T))
    return [(s, min(T, s + per_block)) for s in range(0, T, per_block)]


def contextual(q, k, v, ctx, sink: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ/√Dh + ``ctx.scheme.contextual_bias``, later keys and keys outside the window masked) · v, per
    query block [s, e) against keys a…e−1, a the first key its window shows (0 without one): :func:`_contextual_block`."""
    B, H, T, Dh = q.shape
    out = []
    for s, e in contextual_blocks(B, H, T, q.device.type, ctx.window):
        a = first_key(ctx.window, s)
        out.append(_contextual_block(q[:, :, s:e], k[:, :, a:e], v[:, :, a:e], s, a, ctx, sink))
    return torch.cat(out, dim=2)  # (B, H, T, Dh)


def _contextual_block(q, k, v, s: int, a: int, ctx, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Queries s…s+Q−1, q (B, H, Q, Dh), against keys a…a+K−1, k and v (B, H, K, Dh) → (B, H, Q, Dh). The scores and
    the softmax are in float32 at least (sums of 16-bit gates would round), the product with v in v's dtype; a sink
    (H,) is one more logit in each row's softmax, dropped after it. Its block-sized tensors are freed on return,
    before the next block's are made."""
    Q, K = q.shape[2], k.shape[2]
    i, j = torch.arange(s, s + Q, device=q.device)[:, None], torch.arange(a, a + K, device=q.device)[None, :]
    hidden = ~ctx.window.visible(i, j) if ctx.window is not None else j > i  # (Q, K): later keys, outside the window
    scores = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32))  # (B, H, Q, K)
    scores.mul_(1.0 / math.sqrt(q.shape[-1])).masked_fill_(hidden, float("-inf"))  # (in place: nothing saved here)
    logits = scores + ctx.scheme.contextual_bias(q, scores)  # (B, H, Q, K)
    if sink is None:
        probs = logits.softmax(-1)
    else:  # (B, H, Q, K + 1) with the sink's logit last, then dropped
        column = sink.to(logits.dtype)[:, None, None].expand(*logits.shape[:-1], 1)
        probs = torch.cat((logits, column), dim=-1).softmax(-1)[..., :K]
    if ctx.dropout:
        probs = F.dropout(probs, ctx.dropout)
    return probs.to(v.dtype) @ v  # (B, H, Q, Dh)
