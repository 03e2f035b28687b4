"""The parts of an attention context each kernel needs beyond the positions and rotation tables: Flex's block mask
and score_mod, the folded kernel's key-only bias per block, the banded kernel's far distance and mask pattern, the
dense kernel's blocks and masks. posbench/attention/dispatch.py builds the context (``context``) and calls the
builder of the kernel posbench/attention/choice.py chose; each fills the fields it owns in place.

    banded_context(ctx, per_distance, span, grad)   # ctx: dispatch.Context with its ``table`` built
"""

from __future__ import annotations

import torch

from posbench.attention import blockwise, choice, dense, flex
from posbench.attention.blockwise import banded_pattern, flash_cpu, windowed_table
from posbench.schemes.base import PositionalScheme


def flex_context(ctx, n_head: int, grad: bool) -> None:
    """Flex's BlockMask (causal ∧ the window's) of T + pad queries and keys, its score_mod and kernel options, and
    the table it reads (a trained per-distance table in ``flex.OPTIONS.table_layout``; a learned bias of i and j with
    gradients, FIRE's, as its (H, T, T) pairs), into ``ctx`` (its per-distance ``table`` already built, if any).
    Raises ValueError: Flex missing, dropout, or gradients or a sink on CPU."""
    scheme, pos, window, sink, dtype = ctx.scheme, ctx.pos, ctx.window, ctx.sink, ctx.dtype
    T, device = pos.numel(), pos.device
    if flex.flex_attention is None or ctx.dropout or (grad or sink) and not choice.flex_backward(device):
        raise ValueError("FlexAttention needs torch >= 2.5 and no dropout, and on CPU no gradients and no sink "
                         "(its CPU kernel returns no log-sum-exp)")
    ctx.pad = flex.cpu_padding(T) if device.type == "cpu" else 0  # (torch 2.13's CPU kernel: flex.cpu_padding)
    ctx.block_mask = flex.block_mask(T + ctx.pad, device, window)
    if ctx.table is None and grad and any(p.requires_grad for p in scheme.parameters()):
        ctx.table = scheme.pair_bias(pos, pos, dtype)  # (H, T, T): a learned bias of i and j (FIRE), indexed once
    if ctx.table is not None and ctx.table._base is not None:  # a view's gradient does not reach its base
        ctx.table = ctx.table.clone()  # through Flex's backward (torch 2.13): Flex gets a tensor of its own
    padded = torch.cat((pos, pos[-1] + torch.arange(1, ctx.pad + 1, device=device))) if ctx.pad else pos
    layout = "shared"  # a per-distance table that trains: in flex.OPTIONS.table_layout (flex.layout_table); else as is
    if grad and ctx.table is not None and ctx.table.dim() == 2 and ctx.table.requires_grad:
        layout = flex.OPTIONS.table_layout
        ctx.table = flex.layout_table(ctx.table, padded, layout)  # (H, N), (H, R, N) or (H, T + pad, T + pad)
    ctx.score_mod = flex.score_mod(scheme, padded, ctx.table, layout)
    ctx.kernel_options = flex.kernel_options(device, ctx.table, dtype)


def folded_context(ctx, n_head: int, grad: bool) -> None:
    """The folded kernel's blocks of :data:`~posbench.attention.blockwise.FOLD_QUERIES` queries, each block's key-only
    bias against its middle query (H, end), and, with several blocks where SDPA's fused kernel needs no help, the
    fold mask (Q, T + Q), into ``ctx``. Raises ValueError: a bias that is not key-only, a window or a sink."""
    scheme, pos, window, sink, dtype, dropout = ctx.scheme, ctx.pos, ctx.window, ctx.sink, ctx.dtype, ctx.dropout
    T, device = pos.numel(), pos.device
    if not scheme.key_only_bias or window is not None or sink:
        raise ValueError(f"the folded kernel needs a key-only bias and no window or sink; {type(scheme).__name__}"
                         f".key_only_bias is {scheme.key_only_bias}, window {window}, sink {sink}")
    ctx.blocks = [(s, min(T, s + blockwise.FOLD_QUERIES)) for s in range(0, T, blockwise.FOLD_QUERIES)]
    heads, zero = torch.arange(n_head, device=device)[:, None], torch.zeros((), dtype=dtype, device=device)
    ctx.key_bias = []
    for s, e in ctx.blocks:  # the bias of keys 0…e−1 against the block's middle query: (H, e)
        middle = pos[(s + e - 1) // 2]
        ctx.key_bias.append(scheme.score_mod(zero, heads, middle, pos[None, :e]).to(dtype).expand(n_head, e))
    if len(ctx.blocks) > 1 and (grad or dropout or flash_cpu is None):
        Q = blockwise.FOLD_QUERIES
        ctx.fold_mask = torch.zeros(Q, T + Q, dtype=dtype, device=device)  # (Q, T+Q)
        ctx.fold_mask[:, T:] = torch.full((Q, Q), float("-inf"), dtype=dtype, device=device).triu(1)


def banded_context(ctx, per_distance: bool, span: int | None, grad: bool) -> None:
    """The banded kernel's blocks, far distance and masks, into ``ctx`` (its ``table`` built). A window's keys
    before it are never touched (its far bias is −inf); positions 0…T−1 plus an offset share one mask pattern, with a
    sliding window folded into the table (:func:`~posbench.attention.blockwise.windowed_table`)."""
    scheme, pos, window, dtype = ctx.scheme, ctx.pos, ctx.window, ctx.dtype
    T = pos.numel()
    relative = per_distance or scheme.translation_invariant or not scheme.has_bias
    if flash_cpu is None or not relative or not increasing(pos, span):
        raise ValueError("the banded kernel needs torch's fused CPU attention, a bias of i − j alone "
                         "(distance_table or translation_invariant) and increasing positions")
    if grad and window is None and scheme.far_constant:
        raise ValueError("the banded kernel merges the keys past a far_constant bias's distance by their log-sum-exp, "
                         "which has no gradient: train it with a window, or with another kernel")
    Q = blockwise.FOLD_QUERIES if window is None else dense.WINDOW_QUERIES
    ctx.blocks = [(s, min(T, s + Q)) for s in range(0, T, Q)]
    ctx.far = T if window is None and not scheme.far_constant else window.size if window is not None else \
        scheme.far_distance  # (T: no key is far)
    if window is None and scheme.far_constant:
        far = torch.tensor([ctx.far], device=pos.device)
        ctx.far_bias = scheme.pair_bias(far, torch.zeros_like(far), ctx.table.dtype)[:, 0, 0]  # (H,): distance D
    consecutive = span == T or int(pos[-1] - pos[0]) == T - 1  # 0…T−1 plus an offset: one pattern serves every block
    if consecutive and (window is None or window.kind == "sliding"):
        table = ctx.table if window is None else windowed_table(ctx.table, window.size)
        ctx.masks = [banded_pattern(table, min(Q, T), ctx.far, dtype)]


def dense_context(ctx, n_head: int, grad: bool) -> None:
    """The dense kernel's query blocks (the scheme's own ``dense_rows``, else as many queries as
    :data:`~posbench.attention.dense.BIAS_ELEMENTS` allows), and, when the whole mask fits that budget, every block's
    bias + mask built once for the layers of this context, into ``ctx``."""
    scheme, pos, window, dtype = ctx.scheme, ctx.pos, ctx.window, ctx.dtype
    T, device = pos.numel(), pos.device
    rows = scheme.dense_rows(grad, device) if window is None else None  # a scheme's own block height (FIRE's fold)
    if rows:  # blocks of that many queries (keys up to theirs), each one's mask built as the layer runs it
        Q = min(rows, max(1, dense.BIAS_ELEMENTS // (n_head * T)))
        ctx.blocks = [(s, min(T, s + Q)) for s in range(0, T, Q)]
    else:
        ctx.blocks = dense.dense_blocks(T, n_head, window)
    pairs = T * T if window is None else sum((e - s) * (e - window.first_key(s)) for s, e in ctx.blocks)
    if n_head * pairs <= dense.BIAS_ELEMENTS and not rows:
        ctx.masks = [blockwise.dense_mask(scheme, pos, n_head, s, e, dtype, ctx.table, dense.first_key(window, s), window)
                     for s, e in ctx.blocks]  # the whole mask fits the budget: built once for all layers


def invariant_here(scheme: PositionalScheme, pos: torch.Tensor, device: torch.device, grad: bool) -> bool:
    """Whether an ``invariant_below_limit`` bias (FIRE) is a bias of i − j alone over this window, evaluated on CPU:
    every position and every distance (its table's columns) at most the scheme's :meth:`invariant_limit`. Training
    keeps the bias of every pair, whose gradients sum in the order the runs recorded so far were trained in; so does a
    compiled model (the check reads the positions and a learned value on the host)."""
    if not scheme.invariant_below_limit or grad or device.type != "cpu" or torch.compiler.is_compiling():
        return False
    top, low = int(pos.max()), int(pos.min())
    return max(top, top - low) <= scheme.invariant_limit()


def increasing(pos: torch.Tensor, span: int | None) -> bool:
    """Whether the positions (T,) increase: known for the model's default ones (``span`` = T), else read."""
    return span == pos.numel() or bool((pos[1:] > pos[:-1]).all())


def chunkable(scheme: PositionalScheme, per_distance: bool, pos: torch.Tensor, span: int | None) -> bool:
    """:func:`chunks_batch` of these positions: a bias (not the content's) needs them consecutive."""
    if scheme.contextual or not scheme.has_bias:
        return True
    consecutive = span == pos.numel() or bool((pos[1:] - pos[:-1] == 1).all())
    return consecutive and choice.chunks_batch(scheme, per_distance)
