"""Causal multi-head attention for every positional scheme: which kernel runs, and the kernels.

The model calls :func:`context` once per forward pass and scheme instance (the positions, the scheme's rotation
tables, the kernel and the bias it needs, shared by the layers of that instance: every layer, or one when the scheme
is built per layer), then :func:`attend` once per layer:

    ctx = attention.context(scheme, pos, n_head, x.dtype, dropout)  # pos: (T,) int64, dropout 0 when evaluating
    q, k = scheme.rotate(q, k, ctx.rotation)                          # q, k, v: (B, H, T, Dh)
    y = attention.attend(q, k, v, ctx)                                # (B, H, T, Dh)

The kernel follows from the scheme's class attributes ``contextual``, ``has_bias`` and ``key_only_bias`` (never
from probing a hook), the device, the dtype, whether gradients are on, and dropout (:func:`choose_kernel`):

* ``causal`` — no bias: ``F.scaled_dot_product_attention(is_causal=True)``.
* ``flex`` — a bias on CUDA without dropout (training and evaluation), or on CPU without gradients a bias that is
  neither key-only nor of i − j alone (FIRE over a window that crosses its threshold, with a local layer's window;
  without one it runs ``dense``): FlexAttention
  (posbench/attention/flex.py) with a causal BlockMask and a score_mod that looks the bias up in a table built once per forward
  pass — per distance (H, N) for a ``distance_table`` scheme; per (query, key) pair (H, T, T) for a learned bias of i
  and j when gradients are on (FIRE) — or, otherwise, the scheme's own ``score_mod``. A table's gradient leaves the
  kernel through one indexing op and reaches the parameters outside it. On CPU it has no backward; if it fails to
  compile there, the dense kernel takes over.
* ``folded`` — a key-only bias (ALiBi) on CPU in float32/float64, in training (it evaluates ``banded``): the bias
  against each query block's middle position as one extra head dimension, in SDPA's fused kernels
  (posbench/attention/blockwise.py).
* ``banded`` — on CPU without gradients, a bias of the distance alone (``distance_table`` or
  ``translation_invariant``: T5, KERPLE, Sandwich, ALiBi; FIRE over a window within its threshold,
  ``invariant_below_limit``) in float32/float64: SDPA's fused kernel per block of
  queries with a float mask that slides along one table per distance; a ``far_constant`` bias's far keys unmasked
  (posbench/attention/blockwise.py).
* ``dense``  — all else (CPU training of a bias that is not key-only, dropout with a bias on CUDA; CPU evaluation of
  FIRE past its threshold without a window, in blocks of :data:`FIRE_QUERIES` queries, its masks from the fold of its
  MLP, ``Fire.pair_bias``): bias plus
  causal mask (``scheme.pair_bias``, or the per-distance table indexed by i − j) materialised one block of queries
  at a time (at most :data:`BIAS_ELEMENTS` floats), built once
  per forward pass for the layers of one scheme instance (all of them, or one: ``per_layer``) when the whole mask
  fits in that budget.
* ``contextual`` — a scheme whose bias depends on the content (CoPE, ``contextual = True``), on every device,
  with and without gradients: per block of queries (at most :data:`CONTEXT_ELEMENTS` scores, counting the
  batch), the scores q·kᵀ/√Dh against the keys up to the block's last query, −inf after each query, in float32 at
  least (bf16 under autocast is widened), plus ``scheme.contextual_bias(q, scores)``, then softmax, dropout and
  · v in plain tensor operations. It materialises every (query, key) score of the causal triangle, as the scheme's
  own definition needs. No other scheme reaches it, and no other kernel does anything for it.

* ``remap`` — an evaluation's training-free extension (``eval.remap``: posbench/attention/remap.py; ``context``'s ``remap``),
  whatever the scheme: the layers hand q and k unrotated, and the kernel scores each region of (query, key) pairs at
  its remapped positions, blocks of queries at a time, in one softmax; on CPU in float32/float64 through SDPA's fused
  kernel (posbench/attention/blockwise.py): a bias of i − j alone, or none, reads each region's bias from one vector in one call
  per block (``regions``), a rotary scheme runs one call per region and piece of keys (``rotated``). Never chosen
  otherwise.

Every kernel is causal by index (query t sees keys 0…t of its window) whatever the positions, and passes
gradients to learned parameters used in ``score_mod`` (Flex on CPU is never chosen with gradients on).

**Windows and sinks** (a local layer's, posbench/attention/windows.py; ``model.attn_sink``), given to :func:`context`:

* a ``chunked`` window is causal attention within each chunk of C tokens: where the bias is none, of i − j alone over
  consecutive positions, or the content's (CoPE), the layer's kernel runs on the chunks as one batch (``ctx.chunk``:
  the context is built for C positions, :func:`attend` cuts q, k, v into chunks and joins them back); otherwise (a bias
  of i and j, such as FIRE's past its threshold; positions with gaps) the ``dense`` or ``flex`` kernel takes the mask;
* a ``sliding`` window of W is the bias −inf from distance W on: on CPU, with a bias of i − j alone (or none) over
  consecutive positions, the ``banded`` kernel runs it, in training too (SDPA with the block's float mask, keys from
  s − W + 1: the far keys are never touched); on CUDA, Flex with a block mask that skips the blocks outside it; else
  the ``dense`` (or ``contextual``) kernel's blocks take only the keys the window shows;
* a learned sink logit per head (``sink``, (H,), given to :func:`attend`) joins each query's softmax denominator and
  is dropped: kernels that return a log-sum-exp scale their output by σ(lse − sink) (flex, whose lse takes
  gradients; causal and banded without gradients); otherwise the sink is one more key, zero in q·k and v, whose score
  is the sink: a column of the float mask (dense, banded with gradients) or of the scores (contextual). ``folded``
  takes neither a window nor a sink (its key-only bias would shift the sink's logit per query): it is not chosen then.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from posbench.attention import flex
from posbench.attention import remap as remapping
from posbench.attention.blockwise import (
    FOLD_QUERIES,
    banded,
    banded_pattern,
    dense_mask,
    distance_table,
    flash_cpu,
    folded,
    sunk,
    windowed_table,
    with_sink,
)
from posbench.attention.remap import Prepared, Remap
from posbench.attention.windows import Window, from_chunks, to_chunks
from posbench.schemes.base import PositionalScheme

BIAS_ELEMENTS = 1 << 24  # dense: largest bias block (H · queries · keys floats) built at once, 64 MiB in fp32
CONTEXT_ELEMENTS = 1 << 22  # contextual: largest block of scores (B · H · queries · keys) per step, 16 MiB in fp32
CONTEXT_ELEMENTS_CUDA = 1 << 26  # the same on a GPU, 256 MiB: blocks of a CPU's size leave a GPU launch-bound
WINDOW_QUERIES = 64  # banded with a window: queries per block, each against its block and the W − 1 keys before it
KERNELS = ("causal", "flex", "folded", "banded", "dense", "contextual")  # (and remap: chosen by a remap alone)
QK_NORMS = ("none", "rms")  # model.qk_norm: each head's q and k normalised before the rotation (model.GPT)
QK_NORM_LAYERS = ("all", "local")  # model.qk_norm_layers: every layer, or the L layers of model.layer_pattern
log = logging.getLogger("posbench")

_flex_cpu_works = True  # set False when compiled Flex fails on this CPU (no C++ compiler, …): dense instead


@dataclass
class Context:
    """What every layer's attention needs, computed once per forward pass by :func:`context`.

    Attributes:
        scheme: the positional scheme.
        pos: (T,) int64 absolute positions of the window.
        rotation: ``scheme.rotation(pos, dtype)`` (RoPE: cos and sin tables), for ``scheme.rotate``.
        kernel: one of :data:`KERNELS` (see the module docstring), or ``remap`` (an evaluation's remap).
        dropout: attention-probability dropout of this pass (0 when evaluating).
        blocks: folded and dense: the query blocks (start, end).
        key_bias: folded: per block, the key-only bias (H, end) of keys 0…end−1 against the block's middle
            position, in the activations' dtype.
        fold_mask: folded, several blocks, gradients on: (Q, T + Q), zeros then a square of −inf above the
            diagonal; block [s, e) takes the view [: e − s, T − s : T + e − s] (0 before key s, causal after).
        far: banded: D, the distance from which the bias is the constant ``far_bias`` (H,) of each head; with a
            window, W (the keys from there on are hidden).
        masks: banded, positions 0…T−1 plus an offset: one pattern (H, Q, Q + D − 1) (:func:`banded_pattern`);
            dense: per block, bias + mask (H, end − start, end − first key), or None when they do not all fit
            in :data:`BIAS_ELEMENTS` (then each layer builds them one block at a time).
        block_mask, score_mod: flex: the BlockMask (causal ∧ the window's) of T + ``pad`` queries and keys, and the
            score_mod with Flex's signature (posbench/attention/flex.py).
        table: banded, and flex and dense for a ``distance_table`` scheme (or FIRE within its threshold): the bias
            per distance (H, N) (:func:`distance_table`); flex with a table that takes gradients, in the layout
            ``flex.OPTIONS.table_layout`` (``flex.layout_table``: (H, N), (H, R, N) or (H, T + pad, T + pad));
            flex with gradients, a scheme with learned parameters and no distance table (FIRE): its bias of every
            (query, key) pair (H, T, T), so that Flex's backward indexes each parameter once (Inductor refuses a
            score_mod that indexes a tensor needing gradients twice).
        kernel_options: flex on CUDA: Triton options for Flex's kernels (``flex.kernel_options``: with a table,
            ``flex.TABLE_OPTIONS``; float32 q, k, v, ``flex.OPTIONS.float32_precision``), else None.
        window: the layer's window where it hides keys from this pass's queries (posbench/attention/windows.py), else None;
            with ``chunk`` set, the chunks do that and it is None.
        chunk: C when the kernel runs on chunks of C tokens as a batch (a chunked window): every other field but
            ``rotation`` (of all T positions: q and k turn by their own) then describes one chunk, positions ``pos[:C]``.
        sink: the layers of this context add a learned sink logit to each softmax (:func:`attend`'s ``sink``).
        pad: flex on CPU: the zero rows q, k and v get after their T (``flex.cpu_padding``), later keys to every query.
        remap, prepared: remap: the evaluation's method (posbench/attention/remap.py), and its per-region rotations, bias
            positions or bias vectors, and per-block regions (``remap.prepare``); the layers then pass q and k
            unrotated.
    """

    scheme: PositionalScheme
    pos: torch.Tensor
    rotation: object
    kernel: str
    dropout: float = 0.0
    blocks: list[tuple[int, int]] = field(default_factory=list)
    key_bias: list[torch.Tensor] | None = None
    fold_mask: torch.Tensor | None = None
    masks: list[torch.Tensor] | None = None
    far: int = 0
    far_bias: torch.Tensor | None = None
    block_mask: object = None
    score_mod: object = None
    table: torch.Tensor | None = None
    kernel_options: dict | None = None
    window: Window | None = None
    chunk: int | None = None
    sink: bool = False
    pad: int = 0
    remap: Remap | None = None
    prepared: Prepared | None = None


def context(scheme: PositionalScheme, pos: torch.Tensor, n_head: int, dtype: torch.dtype = torch.float32,
            dropout: float = 0.0, kernel: str | None = None, span: int | None = None, window: Window | None = None,
            sink: bool = False, remap: Remap | None = None) -> Context:
    """The attention context of one forward pass over positions ``pos`` (T,) int64.

    Args:
        scheme: the model's positional scheme.
        n_head: attention heads H.
        dtype: the activations' dtype, or autocast's under autocast (bias and rotation tables are built in it).
        dropout: attention dropout probability of this pass (0 when evaluating).
        kernel: force a kernel (tests, benchmarks); None chooses with :func:`choose_kernel`.
        span: max(pos) − min(pos) + 1 when the caller knows it (T for positions 0…T−1), else None: read from ``pos``
            where a per-distance table needs it (a host sync, and a graph break under torch.compile).
        window: the layers' window (posbench/attention/windows.py), or None: causal attention over every earlier key.
        sink: the layers add a learned sink logit to each softmax (:func:`attend`).
        remap: an evaluation's training-free extension (posbench/attention/remap.py): the ``remap`` kernel, without gradients,
            a window, dropout or a scheme whose positions depend on the content.
    Raises:
        ValueError: an unknown ``kernel``; ``causal`` with a sliding window, or with a sink except when evaluating
            on CPU;
            ``flex`` where FlexAttention is missing, with dropout, or on CPU with
            gradients on or a sink; ``folded`` for a scheme whose bias is not key-only, or with a window or a sink; ``banded``
            without torch's fused CPU attention, for a bias not of i − j alone, for positions that do not increase,
            or with gradients where keys past a ``far_constant`` bias's distance need their log-sum-exp (chosen
            automatically, those run ``folded`` or ``dense``); a ``remap`` with gradients, dropout, a window or a
            contextual scheme.
    """
    T, device, grad = pos.numel(), pos.device, torch.is_grad_enabled()
    if torch.is_autocast_enabled(device.type):  # q and k will be in the autocast dtype
        dtype = torch.get_autocast_dtype(device.type)
    if remap is not None:
        if grad or dropout or window is not None or scheme.contextual:
            raise ValueError("a remap evaluates (no gradients, no dropout) a model without windows, of a scheme whose "
                             "positions are not the content's")
        return Context(scheme, pos, None, "remap", sink=sink, remap=remap,
                       prepared=remapping.prepare(scheme, remap, T, dtype, device))
    window = window if window is not None and window.binds(T) else None
    per_distance = scheme.has_bias and (scheme.distance_table or _invariant_here(scheme, pos, device, grad))  # by i − j
    if window is not None and window.kind == "chunked" and _chunkable(scheme, per_distance, pos, span):
        C = window.size  # every chunk is causal attention over C positions that differ as 0…C−1 do
        ctx = context(scheme, pos[:C], n_head, dtype, dropout, kernel, C if span == T else None, None, sink)
        ctx.rotation, ctx.chunk = scheme.rotation(pos, dtype), C  # (q and k turn by their own positions)
        return ctx
    if kernel is None:
        kernel = choose_kernel(scheme, device, dtype, dropout, grad, per_distance, window, sink)
        if kernel == "banded" and not _increasing(pos, span):  # (banded's far keys are those far by index)
            kernel = "folded" if scheme.key_only_bias and window is None and not sink else "dense"
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if kernel == "causal" and (window is not None or sink and (grad or flash_cpu is None or device.type != "cpu")):
        raise ValueError("the causal kernel takes no window, and a sink only when evaluating on CPU (from SDPA's "
                         "log-sum-exp)")
    ctx = Context(scheme, pos, scheme.rotation(pos, dtype), kernel, dropout, window=window, sink=sink)
    if kernel in ("flex", "dense") and per_distance or kernel == "banded":
        ctx.table = (distance_table(scheme, pos, dtype, span) if scheme.has_bias else  # (H, N), or (1, N) of zeros
                     torch.zeros(1, span or int(pos.max() - pos.min()) + 1, dtype=dtype, device=device))
    if kernel == "flex":
        if flex.flex_attention is None or dropout or (grad or sink) and not flex_backward(device):
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
    elif kernel == "folded":
        if not scheme.key_only_bias or window is not None or sink:
            raise ValueError(f"the folded kernel needs a key-only bias and no window or sink; {type(scheme).__name__}"
                             f".key_only_bias is {scheme.key_only_bias}, window {window}, sink {sink}")
        ctx.blocks = [(s, min(T, s + FOLD_QUERIES)) for s in range(0, T, FOLD_QUERIES)]
        heads, zero = torch.arange(n_head, device=device)[:, None], torch.zeros((), dtype=dtype, device=device)
        ctx.key_bias = []
        for s, e in ctx.blocks:  # the bias of keys 0…e−1 against the block's middle query: (H, e)
            middle = pos[(s + e - 1) // 2]
            ctx.key_bias.append(scheme.score_mod(zero, heads, middle, pos[None, :e]).to(dtype).expand(n_head, e))
        if len(ctx.blocks) > 1 and (grad or dropout or flash_cpu is None):
            Q = FOLD_QUERIES
            ctx.fold_mask = torch.zeros(Q, T + Q, dtype=dtype, device=device)  # (Q, T+Q)
            ctx.fold_mask[:, T:] = torch.full((Q, Q), float("-inf"), dtype=dtype, device=device).triu(1)
    elif kernel == "banded":
        _banded_context(ctx, scheme, per_distance, span, grad, dtype)
    elif kernel == "dense":
        ctx.blocks = _dense_blocks(T, n_head, window)
        fire = scheme.invariant_below_limit and not grad and window is None and device.type == "cpu"  # FIRE past its
        if fire:  # threshold, evaluated: blocks of its pair_bias's sheared rows (keys up to theirs), each one's mask
            Q = min(scheme.FOLD_ROWS, max(1, BIAS_ELEMENTS // (n_head * T)))  # built as the layer runs it
            ctx.blocks = [(s, min(T, s + Q)) for s in range(0, T, Q)]
        pairs = T * T if window is None else sum((e - s) * (e - window.first_key(s)) for s, e in ctx.blocks)
        if n_head * pairs <= BIAS_ELEMENTS and not fire:
            ctx.masks = [dense_mask(scheme, pos, n_head, s, e, dtype, ctx.table, _first_key(window, s), window)
                         for s, e in ctx.blocks]  # the whole mask fits the budget: built once for all layers
    return ctx


def _banded_context(ctx: Context, scheme: PositionalScheme, per_distance: bool, span: int | None, grad: bool,
                    dtype: torch.dtype) -> None:
    """The banded kernel's blocks, far distance and masks, into ``ctx`` (its ``table`` built). A window's keys
    before it are never touched (its far bias is −inf); positions 0…T−1 plus an offset share one mask pattern, with a
    sliding window folded into the table (:func:`~posbench.attention.blockwise.windowed_table`)."""
    pos, T, window = ctx.pos, ctx.pos.numel(), ctx.window
    relative = per_distance or scheme.translation_invariant or not scheme.has_bias
    if flash_cpu is None or not relative or not _increasing(pos, span):
        raise ValueError("the banded kernel needs torch's fused CPU attention, a bias of i − j alone "
                         "(distance_table or translation_invariant) and increasing positions")
    if grad and window is None and scheme.far_constant:
        raise ValueError("the banded kernel merges the keys past a far_constant bias's distance by their log-sum-exp, "
                         "which has no gradient: train it with a window, or with another kernel")
    Q = FOLD_QUERIES if window is None else WINDOW_QUERIES
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


def _invariant_here(scheme: PositionalScheme, pos: torch.Tensor, device: torch.device, grad: bool) -> bool:
    """Whether an ``invariant_below_limit`` bias (FIRE) is a bias of i − j alone over this window, evaluated on CPU:
    every position and every distance (its table's columns) at most the scheme's :meth:`invariant_limit`. Training
    keeps the bias of every pair, whose gradients sum in the order the runs recorded so far were trained in; so does a
    compiled model (the check reads the positions and a learned value on the host)."""
    if not scheme.invariant_below_limit or grad or device.type != "cpu" or torch.compiler.is_compiling():
        return False
    top, low = int(pos.max()), int(pos.min())
    return max(top, top - low) <= scheme.invariant_limit()


def _increasing(pos: torch.Tensor, span: int | None) -> bool:
    """Whether the positions (T,) increase: known for the model's default ones (``span`` = T), else read."""
    return span == pos.numel() or bool((pos[1:] > pos[:-1]).all())


def chunks_batch(scheme: type[PositionalScheme] | PositionalScheme, per_distance: bool | None = None) -> bool:
    """Whether a chunked window of ``scheme`` (a class or an instance) may run on its chunks as one batch, positions
    0…T−1 plus an offset given: every chunk's scores are those of positions 0…C−1 — no bias, a bias of i − j alone
    (``per_distance``, None: ``distance_table``; or ``translation_invariant``), or one of the content (CoPE)."""
    per_distance = scheme.distance_table if per_distance is None else per_distance
    return scheme.contextual or not scheme.has_bias or per_distance or scheme.translation_invariant


def _chunkable(scheme: PositionalScheme, per_distance: bool, pos: torch.Tensor, span: int | None) -> bool:
    """:func:`chunks_batch` of these positions: a bias (not the content's) needs them consecutive."""
    if scheme.contextual or not scheme.has_bias:
        return True
    consecutive = span == pos.numel() or bool((pos[1:] - pos[:-1] == 1).all())
    return consecutive and chunks_batch(scheme, per_distance)


def _first_key(window: Window | None, s: int) -> int:
    """The first key a query block starting at ``s`` attends to: 0 without a window."""
    return 0 if window is None else window.first_key(s)


def flex_backward(device: torch.device) -> bool:
    """Whether FlexAttention has a backward on ``device``: not on CPU (torch refuses inputs that need gradients)."""
    return device.type != "cpu"


def choose_kernel(scheme: PositionalScheme, device: torch.device, dtype: torch.dtype, dropout: float,
                  grad: bool, per_distance: bool | None = None, window: Window | None = None,
                  sink: bool = False) -> str:
    """The kernel the module docstring describes for ``scheme`` on ``device`` with activations in ``dtype``,
    this attention dropout, and gradients on (``grad``) or off; ``per_distance``: the bias runs from a table per
    distance (None: ``scheme.distance_table``; :func:`context` also says so of FIRE within its threshold);
    ``window``: a window that hides keys, which :func:`context` does not run on chunks (a sliding one, or a chunked one
    whose bias is not of i − j alone); ``sink``: a learned sink logit joins each softmax."""
    if scheme.contextual:
        return "contextual"
    plain = window is None and not sink
    if not scheme.has_bias and plain:
        return "causal"
    fused = flex.flex_attention is not None and not dropout
    if device.type == "cuda" and fused:
        return "flex"
    per_distance = scheme.distance_table if per_distance is None else per_distance
    wide = dtype in (torch.float32, torch.float64)
    relative = per_distance or scheme.translation_invariant or not scheme.has_bias  # a bias of i − j alone, or none
    if device.type == "cpu" and relative and not dropout and wide and flash_cpu is not None:
        if not grad:
            return "banded" if scheme.has_bias or window is not None else "causal"  # (causal: a sink's lse)
        if window is not None:
            return "banded"  # (a window's far keys are masked: nothing needs a log-sum-exp's gradient)
    if device.type == "cpu" and scheme.key_only_bias and wide and plain:
        return "folded"  # (an 8-bit mantissa would round a folded bias of 64 by 0.25)
    if device.type == "cpu" and not grad and scheme.invariant_below_limit and window is None:
        return "dense"  # FIRE past its threshold: its pair_bias's fold (Fire.fold) and small blocks beat Flex's score_mod
    if device.type == "cpu" and fused and not grad and _flex_cpu_works and not sink and wide:
        return "flex"  # (not with a sink: Flex on CPU returns no log-sum-exp; not in bf16: torch 2.13's compiled CPU
        # kernel was off by up to 2.4 in bf16 outputs where eager Flex and SDPA were within 0.013 of float64)
    return "dense"


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Context,
           sink: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ/√Dh + bias, keys after the query or outside the window masked) · v with the kernel of ``ctx``;
    with ``sink`` (H,), each softmax's denominator also holds exp(sink_h) (a learned logit with no value: GPT-OSS's
    attention sinks), so that a query may attend to nothing.

    q, k, v: (B, H, T, Dh), q and k already rotated where the scheme rotates (not for ``remap``: it turns them per
    region) → (B, H, T, Dh).
    """
    if ctx.sink != (sink is not None):
        raise ValueError(f"the context was built {'with' if ctx.sink else 'without'} a sink, and attend got "
                         f"{'one' if sink is not None else 'none'}")
    if ctx.chunk:  # a chunked window: the kernel runs on the chunks as a batch
        B, T = q.shape[0], q.shape[2]
        q, k, v = (to_chunks(t, ctx.chunk) for t in (q, k, v))  # (B·n, H, C, Dh)
        return from_chunks(_run(q, k, v, ctx, sink), B, T)  # (B, H, T, Dh)
    return _run(q, k, v, ctx, sink)


def _run(q, k, v, ctx: Context, sink: torch.Tensor | None) -> torch.Tensor:
    """:func:`attend`'s kernel call."""
    if ctx.kernel == "causal":
        if sink is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=ctx.dropout, is_causal=True)  # (B, H, T, Dh)
        y, lse = flash_cpu(q, k, v, 0.0, True)  # (B, H, T, Dh), (B, H, T): evaluation on CPU
        return sunk(y, lse, sink)
    if ctx.kernel == "folded":
        return folded(q, k, v, ctx)
    if ctx.kernel == "banded":
        return banded(q, k, v, ctx, sink)
    if ctx.kernel == "flex":
        return _flex_attend(q, k, v, ctx, sink)
    if ctx.kernel == "contextual":
        return _contextual(q, k, v, ctx, sink)
    if ctx.kernel == "remap":
        return remapping.attend(q, k, v, ctx.scheme, ctx.prepared, sink)
    return _dense(q, k, v, ctx, sink)


# ---- dense: bias + causal mask, one block of queries at a time -------------------------------------------


def _dense_blocks(T: int, n_head: int, window: Window | None = None) -> list[tuple[int, int]]:
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


def _dense(q, k, v, ctx: Context, sink: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA with a float mask per query block against the keys its window shows (all earlier ones without a window):
    the context's masks, or each block's built here; a sink as one more key (:func:`~posbench.attention.blockwise.with_sink`)."""
    H, T = q.shape[1], q.shape[2]
    out = []
    for i, (s, e) in enumerate(ctx.blocks if ctx.kernel == "dense" else _dense_blocks(T, H, ctx.window)):
        a = _first_key(ctx.window, s)
        table = ctx.table if ctx.table is not None and ctx.table.dim() == 2 else None  # (not a flex (H, T, T) bias)
        mask = ctx.masks[i] if ctx.masks else dense_mask(ctx.scheme, ctx.pos, H, s, e, q.dtype, table, a, ctx.window)
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


def _contextual(q, k, v, ctx: Context, sink: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ/√Dh + ``ctx.scheme.contextual_bias``, later keys and keys outside the window masked) · v, per
    query block [s, e) against keys a…e−1, a the first key its window shows (0 without one): :func:`_contextual_block`."""
    B, H, T, Dh = q.shape
    out = []
    for s, e in contextual_blocks(B, H, T, q.device.type, ctx.window):
        a = _first_key(ctx.window, s)
        out.append(_contextual_block(q[:, :, s:e], k[:, :, a:e], v[:, :, a:e], s, a, ctx, sink))
    return torch.cat(out, dim=2)  # (B, H, T, Dh)


def _contextual_block(q, k, v, s: int, a: int, ctx: Context, sink: torch.Tensor | None = None) -> torch.Tensor:
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


def _flex_attend(q, k, v, ctx: Context, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Compiled FlexAttention (posbench/attention/flex.py), a sink through its log-sum-exp (the output times σ(lse − sink)); on a
    CPU where it fails to compile, the dense kernel, from then on."""
    global _flex_cpu_works
    T = q.shape[2]
    if q.device.type != "cpu" or torch.compiler.is_compiling() or _flex_cpu_works:
        try:
            qp, kp, vp = (F.pad(t, (0, 0, 0, ctx.pad)) for t in (q, k, v)) if ctx.pad else (q, k, v)
            out = flex.run(qp, kp, vp, ctx.score_mod, ctx.block_mask, ctx.kernel_options, lse=sink is not None)
            if sink is None:
                return out[:, :, :T]  # (B, H, T, Dh)
            return sunk(out[0][:, :, :T], out[1][:, :, :T], sink)  # (B, H, T, Dh), (B, H, T)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            raise
        except Exception as err:  # noqa: BLE001 - any compiler failure on CPU: fall back, once, with the reason
            if q.device.type != "cpu" or torch.compiler.is_compiling():
                raise
            _flex_cpu_works = False
            log.warning("FlexAttention does not compile on this CPU (%s: %s); using the dense attention kernel",
                        type(err).__name__, str(err).splitlines()[0] if str(err) else "")
    return _dense(q, k, v, ctx, sink)
