"""Causal multi-head attention for every positional scheme: what the model calls.

The model calls :func:`context` once per forward pass and scheme instance (the positions, the scheme's rotation
tables, the kernel and the bias it needs, shared by the layers of that instance: every layer, or one when the scheme
is built per layer), then :func:`attend` once per layer:

    ctx = dispatch.context(scheme, pos, n_head, x.dtype, dropout)   # pos: (T,) int64, dropout 0 when evaluating
    q, k = scheme.rotate(q, k, ctx.rotation)                          # q, k, v: (B, H, T, Dh)
    y = dispatch.attend(q, k, v, ctx)                                 # (B, H, T, Dh)

Which kernel runs, and what each does with windows and sinks: posbench/attention/choice.py. The parts of a context
each kernel needs: posbench/attention/builders.py; the kernels: blockwise.py (SDPA's fused CPU kernel per block),
flex.py, dense.py (plain tensor operations), remap_kernel.py (an evaluation's remap).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from posbench.attention import flex, remap_kernel
from posbench.attention.blockwise import banded, distance_table, flash_cpu, folded, sunk
from posbench.attention.builders import (
    banded_context,
    chunkable,
    dense_context,
    flex_context,
    folded_context,
    increasing,
    invariant_here,
)
from posbench.attention.choice import KERNELS, choose_kernel
from posbench.attention.dense import contextual, dense
from posbench.attention.remap import Remap
from posbench.attention.remap_kernel import Prepared
from posbench.attention.windows import Window, from_chunks, to_chunks
from posbench.schemes.base import PositionalScheme

QK_NORMS = ("none", "rms")  # model.qk_norm: each head's q and k normalised before the rotation (model.GPT)
QK_NORM_LAYERS = ("all", "local")  # model.qk_norm_layers: every layer, or the L layers of model.layer_pattern
log = logging.getLogger("posbench")


@dataclass
class Context:
    """What every layer's attention needs, computed once per forward pass by :func:`context`.

    Attributes:
        scheme: the positional scheme.
        pos: (T,) int64 absolute positions of the window.
        rotation: ``scheme.rotation(pos, dtype)`` (RoPE: cos and sin tables), for ``scheme.rotate``.
        kernel: one of ``choice.KERNELS`` (posbench/attention/choice.py), or ``remap`` (an evaluation's remap).
        dropout: attention-probability dropout of this pass (0 when evaluating).
        blocks: folded and dense: the query blocks (start, end).
        key_bias: folded: per block, the key-only bias (H, end) of keys 0…end−1 against the block's middle
            position, in the activations' dtype.
        fold_mask: folded, several blocks, gradients on: (Q, T + Q), zeros then a square of −inf above the
            diagonal; block [s, e) takes the view [: e − s, T − s : T + e − s] (0 before key s, causal after).
        far: banded: D, the distance from which the bias is the constant ``far_bias`` (H,) of each head; with a
            window, W (the keys from there on are hidden).
        masks: banded, positions 0…T−1 plus an offset: one pattern (H, Q, Q + D − 1) (``blockwise.banded_pattern``);
            dense: per block, bias + mask (H, end − start, end − first key), or None when they do not all fit
            in ``dense.BIAS_ELEMENTS`` (then each layer builds them one block at a time).
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
        dtype: the activations' dtype (autocast's under autocast): bias tables and masks are built in it.
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
    dtype: torch.dtype = torch.float32


def context(scheme: PositionalScheme, pos: torch.Tensor, n_head: int, dtype: torch.dtype = torch.float32,
            dropout: float = 0.0, kernel: str | None = None, span: int | None = None, window: Window | None = None,
            sink: bool = False, remap: Remap | None = None) -> Context:
    """The attention context of one forward pass over positions ``pos`` (T,) int64.

    Args:
        scheme: the model's positional scheme.
        n_head: attention heads H.
        dtype: the activations' dtype, or autocast's under autocast (bias and rotation tables are built in it).
        dropout: attention dropout probability of this pass (0 when evaluating).
        kernel: force a kernel (tests, benchmarks); None chooses with ``choice.choose_kernel``.
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
                       prepared=remap_kernel.prepare(scheme, remap, T, dtype, device))
    window = window if window is not None and window.binds(T) else None
    per_distance = scheme.has_bias and (scheme.distance_table or invariant_here(scheme, pos, device, grad))  # by i − j
    if window is not None and window.kind == "chunked" and chunkable(scheme, per_distance, pos, span):
        C = window.size  # every chunk is causal attention over C positions that differ as 0…C−1 do
        ctx = context(scheme, pos[:C], n_head, dtype, dropout, kernel, C if span == T else None, None, sink)
        ctx.rotation, ctx.chunk = scheme.rotation(pos, dtype), C  # (q and k turn by their own positions)
        return ctx
    if kernel is None:
        kernel = choose_kernel(scheme, device, dtype, dropout, grad, per_distance, window, sink)
        if kernel == "banded" and not increasing(pos, span):  # (banded's far keys are those far by index)
            kernel = "folded" if scheme.key_only_bias and window is None and not sink else "dense"
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if kernel == "causal" and (window is not None or sink and (grad or flash_cpu is None or device.type != "cpu")):
        raise ValueError("the causal kernel takes no window, and a sink only when evaluating on CPU (from SDPA's "
                         "log-sum-exp)")
    ctx = Context(scheme, pos, scheme.rotation(pos, dtype), kernel, dropout, window=window, sink=sink, dtype=dtype)
    if kernel in ("flex", "dense") and per_distance or kernel == "banded":
        ctx.table = (distance_table(scheme, pos, dtype, span) if scheme.has_bias else  # (H, N), or (1, N) of zeros
                     torch.zeros(1, span or int(pos.max() - pos.min()) + 1, dtype=dtype, device=device))
    if kernel == "flex":
        flex_context(ctx, n_head, grad)
    elif kernel == "folded":
        folded_context(ctx, n_head, grad)
    elif kernel == "banded":
        banded_context(ctx, per_distance, span, grad)
    elif kernel == "dense":
        dense_context(ctx, n_head, grad)
    return ctx


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
        return contextual(q, k, v, ctx, sink)
    if ctx.kernel == "remap":
        return remap_kernel.attend(q, k, v, ctx.scheme, ctx.prepared, sink)
    return dense(q, k, v, ctx, sink)


def _flex_attend(q, k, v, ctx: Context, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Compiled FlexAttention (posbench/attention/flex.py), a sink through its log-sum-exp (the output times σ(lse − sink)); on a
    CPU where it fails to compile, the dense kernel, from then on."""
    T = q.shape[2]
    if q.device.type != "cpu" or torch.compiler.is_compiling() or flex.cpu_compiles:
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
            flex.cpu_compiles = False
            log.warning("FlexAttention does not compile on this CPU (%s: %s); using the dense attention kernel",
                        type(err).__name__, str(err).splitlines()[0] if str(err) else "")
    return dense(q, k, v, ctx, sink)
