"""Which attention kernel runs: for a scheme (its class facts), the device, the dtype, gradients, dropout, a window
and a sink. Every kernel computes softmax(q·kᵀ/√Dh + bias, causal and window masks) · v.

The kernel follows from the scheme's class attributes ``contextual``, ``has_bias`` and ``key_only_bias`` (never
from probing a hook; ``dense_rows``, a scheme's own block height, aside), the device, the dtype, whether gradients are
on, and dropout (:func:`choose_kernel`; posbench/attention/dispatch.py builds each one's context,
posbench/attention/builders.py its parts):

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
  FIRE past its threshold without a window, in blocks of the rows its ``dense_rows`` asks for, its masks from the fold of
  its MLP, ``Fire.pair_bias``): bias plus
  causal mask (``scheme.pair_bias``, or the per-distance table indexed by i − j) materialised one block of queries
  at a time (at most ``dense.BIAS_ELEMENTS`` floats), built once
  per forward pass for the layers of one scheme instance (all of them, or one: ``per_layer``) when the whole mask
  fits in that budget.
* ``contextual`` — a scheme whose bias depends on the content (CoPE, ``contextual = True``), on every device,
  with and without gradients: per block of queries (at most ``dense.CONTEXT_ELEMENTS`` scores, counting the
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

**Windows and sinks** (a local layer's, posbench/attention/windows.py; ``model.attn_sink``), given to ``dispatch.context``:

* a ``chunked`` window is causal attention within each chunk of C tokens: where the bias is none, of i − j alone over
  consecutive positions, or the content's (CoPE), the layer's kernel runs on the chunks as one batch (``ctx.chunk``:
  the context is built for C positions, ``dispatch.attend`` cuts q, k, v into chunks and joins them back); otherwise (a bias
  of i and j, such as FIRE's past its threshold; positions with gaps) the ``dense`` or ``flex`` kernel takes the mask;
* a ``sliding`` window of W is the bias −inf from distance W on: on CPU, with a bias of i − j alone (or none) over
  consecutive positions, the ``banded`` kernel runs it, in training too (SDPA with the block's float mask, keys from
  s − W + 1: the far keys are never touched); on CUDA, Flex with a block mask that skips the blocks outside it; else
  the ``dense`` (or ``contextual``) kernel's blocks take only the keys the window shows;
* a learned sink logit per head (``sink``, (H,), given to ``dispatch.attend``) joins each query's softmax denominator and
  is dropped: kernels that return a log-sum-exp scale their output by σ(lse − sink) (flex, whose lse takes
  gradients; causal and banded without gradients); otherwise the sink is one more key, zero in q·k and v, whose score
  is the sink: a column of the float mask (dense, banded with gradients) or of the scores (contextual). ``folded``
  takes neither a window nor a sink (its key-only bias would shift the sink's logit per query): it is not chosen then.
"""

from __future__ import annotations

import torch

from posbench.attention import blockwise, flex
from posbench.attention.windows import Window
from posbench.schemes.base import PositionalScheme

KERNELS = ("causal", "flex", "folded", "banded", "dense", "contextual")  # (and remap: chosen by a remap alone)


def flex_backward(device: torch.device) -> bool:
    """Whether FlexAttention has a backward on ``device``: not on CPU (torch refuses inputs that need gradients)."""
    return device.type != "cpu"


def chunks_batch(scheme: type[PositionalScheme] | PositionalScheme, per_distance: bool | None = None) -> bool:
    """Whether a chunked window of ``scheme`` (a class or an instance) may run on its chunks as one batch, positions
    0…T−1 plus an offset given: every chunk's scores are those of positions 0…C−1 — no bias, a bias of i − j alone
    (``per_distance``, None: ``distance_table``; or ``translation_invariant``), or one of the content (CoPE)."""
    per_distance = scheme.distance_table if per_distance is None else per_distance
    return scheme.contextual or not scheme.has_bias or per_distance or scheme.translation_invariant


def choose_kernel(scheme: PositionalScheme, device: torch.device, dtype: torch.dtype, dropout: float,
                  grad: bool, per_distance: bool | None = None, window: Window | None = None,
                  sink: bool = False) -> str:
    """The kernel the module docstring describes for ``scheme`` on ``device`` with activations in ``dtype``,
    this attention dropout, and gradients on (``grad``) or off; ``per_distance``: the bias runs from a table per
    distance (None: ``scheme.distance_table``; ``dispatch.context`` also says so of FIRE within its threshold);
    ``window``: a window that hides keys, which ``dispatch.context`` does not run on chunks (a sliding one, or a chunked one
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
    if relative and not dropout and blockwise.fused_cpu(dtype, device):
        if not grad:
            return "banded" if scheme.has_bias or window is not None else "causal"  # (causal: a sink's lse)
        if window is not None:
            return "banded"  # (a window's far keys are masked: nothing needs a log-sum-exp's gradient)
    if device.type == "cpu" and scheme.key_only_bias and wide and plain:
        return "folded"  # (an 8-bit mantissa would round a folded bias of 64 by 0.25)
    if window is None and scheme.dense_rows(grad, device):
        return "dense"  # FIRE past its threshold: its pair_bias's fold (Fire.fold) and small blocks beat Flex's score_mod
    if device.type == "cpu" and fused and not grad and flex.cpu_compiles and not sink and wide:
        return "flex"  # (not with a sink: Flex on CPU returns no log-sum-exp; not in bf16: torch 2.13's compiled CPU
        # kernel was off by up to 2.4 in bf16 outputs where eager Flex and SDPA were within 0.013 of float64)
    return "dense"
