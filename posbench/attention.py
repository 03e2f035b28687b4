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
* ``flex``   — a bias on CUDA without dropout (training and evaluation), or on CPU without gradients a bias
  that is neither key-only nor a per-distance table (FIRE): FlexAttention (``torch.nn.attention.flex_attention``, PyTorch ≥ 2.5; Dong et al.
  2024, arXiv:2412.05496) with a causal BlockMask (cached per length) and a score_mod that looks the bias up in a
  table built once per forward pass — per distance (H, N) for a ``distance_table`` scheme; per (query, key) pair
  (H, T, T) for a learned bias of i and j when gradients are on (FIRE) — or, otherwise, the scheme's own
  ``score_mod``. A table's gradient leaves the kernel through one indexing op and reaches the parameters outside
  it. Compiled once per process, with automatic dynamic shapes (the second length compiles a dynamic kernel that
  most later lengths reuse; each compilation is logged, "compiling the attention kernel for length T") and a recompile
  limit that raises rather than fall back to Flex's eager form (:data:`FLEX_VARIANTS`; :func:`reset_compiled`
  between jobs). On CPU it has no backward; if it fails to compile there, the dense kernel takes over.
* ``folded`` — a key-only bias (ALiBi) on CPU in float32/float64 (training; it evaluates ``banded``). Softmax ignores a term constant across a
  query's row, so Press et al. 2022 (§3)'s −m·(i − j) may be replaced by the key-only −m·(c − j) for a
  reference position c, which is one extra head dimension: q' = (q/√Dh, 1), k' = (k, bias(c, j)),
  v' = (v, 0) at scale 1 give q·k/√Dh + bias(c, j) in SDPA's fused kernels. Queries go in blocks of
  :data:`FOLD_QUERIES`, c the middle of each, so the folded bias of the keys a query attends to stays small:
  fp32 keeps ~1e-6, where one c for 8192 positions loses ~1e-4. A window of one block runs causal SDPA;
  without gradients a longer one runs, per block, a causal diagonal square and the unmasked keys before it,
  merged by their log-sum-exps; with gradients, each block against all its keys with a causal float mask.
* ``banded`` — on CPU without gradients, a bias of the distance alone (``distance_table`` or
  ``translation_invariant``: T5, KERPLE, Sandwich, ALiBi), in float32/float64, from its table per distance (H, N).
  A ``far_constant`` bias (T5 past ``max_distance``) is the same constant c_h for every distance from D on. Per block of :data:`FOLD_QUERIES` queries
  [s, e), the keys j ≤ s − D all carry that head's constant c_h: one unmasked SDPA over them, whose log-sum-exp
  takes + c_h. The keys after them carry the table's bias, indexed by i − j, and the causal mask: one SDPA with a
  float mask of (H, e − s, e − s + D − 1). Both outputs are merged by their log-sum-exps, as in ``folded``. With
  positions 0…T−1 plus an offset, every block's mask is a slice of one (H, Q, Q + D − 1) pattern built once per
  forward pass (a sliding view, no copy). Otherwise (randomized positions, which must increase) each layer builds
  each block's mask.
* ``dense``  — all else (CPU training of a bias that is not key-only, dropout with a bias on CUDA): bias plus
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

Every kernel is causal by index (query t sees keys 0…t of its window) whatever the positions, and passes
gradients to learned parameters used in ``score_mod`` (Flex on CPU is never chosen with gradients on).

Measured (model=tiny: 4 layers, D 128, 4 heads, V 4096; 2 CPU threads, fp32, batch 1, no-grad forward, time
over causal SDPA's): ALiBi folded 1.10× at 2048 tokens and 1.20× at 8192; the same bias through Flex compiled
on CPU 1.30× and 1.57× (plus ~7 s of compilation per length), through the dense kernel 2.43× and 4.00×.
Hence CPU runs ALiBi folded, a per-distance bias banded (evaluation), and Flex for evaluation of a bias of i and
j (FIRE). CoPE through the contextual
kernel: see scripts/benchmark.py for its cost against causal SDPA.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from posbench.schemes.base import PositionalScheme

BIAS_ELEMENTS = 1 << 24  # dense: largest bias block (H · queries · keys floats) built at once, 64 MiB in fp32
FOLD_QUERIES = 256  # folded: queries per block; |query − c| ≤ 128 positions keeps the fp32 bias error ≲ 4e-6
CONTEXT_ELEMENTS = 1 << 22  # contextual: largest block of scores (B · H · queries · keys) per step, 16 MiB in fp32
CONTEXT_ELEMENTS_CUDA = 1 << 26  # the same on a GPU, 256 MiB: blocks of a CPU's size leave a GPU launch-bound
KERNELS = ("causal", "flex", "folded", "banded", "dense", "contextual")
ATTN_SCALES = ("none", "log_n", "ssmax")  # model.attn_scale: a factor on the queries before any kernel (model.GPT)
log = logging.getLogger("posbench")

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch < 2.5
    flex_attention = create_block_mask = None
# SDPA's fused CPU kernel, which also returns each query's log-sum-exp (B, H, Tq); no gradient flows through
# the log-sum-exp, so it serves evaluation only. A private ATen op (torch ≥ 2.2): None where it is missing.
_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flex_cpu_works = True  # set False when compiled Flex fails on this CPU (no C++ compiler, …): dense instead


@dataclass
class Context:
    """What every layer's attention needs, computed once per forward pass by :func:`context`.

    Attributes:
        scheme: the positional scheme.
        pos: (T,) int64 absolute positions of the window.
        rotation: ``scheme.rotation(pos, dtype)`` (RoPE: cos and sin tables), for ``scheme.rotate``.
        kernel: one of :data:`KERNELS` (see the module docstring).
        dropout: attention-probability dropout of this pass (0 when evaluating).
        blocks: folded and dense: the query blocks (start, end).
        key_bias: folded: per block, the key-only bias (H, end) of keys 0…end−1 against the block's middle
            position, in the activations' dtype.
        fold_mask: folded, several blocks, gradients on: (Q, T + Q), zeros then a square of −inf above the
            diagonal; block [s, e) takes the view [: e − s, T − s : T + e − s] (0 before key s, causal after).
        far: banded: D, the distance from which the bias is the constant ``far_bias`` (H,) of each head.
        masks: banded, positions 0…T−1 plus an offset: one pattern (H, Q, Q + D − 1) (:func:`_banded_pattern`);
            dense: per block, bias + causal mask (H, end − start, end), or None when they do not all fit
            in :data:`BIAS_ELEMENTS` (then each layer builds them one block at a time).
        block_mask, score_mod: flex: the causal BlockMask of length T and the score_mod with Flex's signature
            (:func:`_flex_score_mod`).
        table: flex and dense, a ``distance_table`` scheme: its bias per distance (H, N) (:func:`distance_table`);
            flex with gradients, a scheme with learned parameters and no distance table (FIRE): its bias of every
            (query, key) pair (H, T, T), so that Flex's backward indexes each parameter once (Inductor refuses a
            score_mod that indexes a tensor needing gradients twice).
        kernel_options: flex on CUDA with a table: Triton options for Flex's kernels (:data:`FLEX_TABLE_OPTIONS`).
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


def context(scheme: PositionalScheme, pos: torch.Tensor, n_head: int, dtype: torch.dtype = torch.float32,
            dropout: float = 0.0, kernel: str | None = None, span: int | None = None) -> Context:
    """The attention context of one forward pass over positions ``pos`` (T,) int64.

    Args:
        scheme: the model's positional scheme.
        n_head: attention heads H.
        dtype: the activations' dtype, or autocast's under autocast (bias and rotation tables are built in it).
        dropout: attention dropout probability of this pass (0 when evaluating).
        kernel: force a kernel (tests, benchmarks); None chooses with :func:`choose_kernel`.
        span: max(pos) − min(pos) + 1 when the caller knows it (T for positions 0…T−1), else None: read from ``pos``
            where a per-distance table needs it (a host sync, and a graph break under torch.compile).
    Raises:
        ValueError: an unknown ``kernel``; ``flex`` where FlexAttention is missing, with dropout, or on CPU with
            gradients on; ``folded`` for a scheme whose bias is not key-only; ``banded`` without torch's fused CPU
            attention, for a bias not of i − j alone, or for positions that do not increase (chosen automatically,
            those run ``folded`` or ``dense``).
    """
    T, device, grad = pos.numel(), pos.device, torch.is_grad_enabled()
    if torch.is_autocast_enabled(device.type):  # q and k will be in the autocast dtype
        dtype = torch.get_autocast_dtype(device.type)
    if kernel is None:
        kernel = choose_kernel(scheme, device, dtype, dropout, grad)
        if kernel == "banded" and not _increasing(pos, span):  # (banded's far keys are those far by index)
            kernel = "folded" if scheme.key_only_bias else "dense"
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    ctx = Context(scheme, pos, scheme.rotation(pos, dtype), kernel, dropout)
    if kernel in ("flex", "dense") and scheme.distance_table or kernel == "banded":
        ctx.table = distance_table(scheme, pos, dtype, span)  # (H, N)
    if kernel == "flex":
        if flex_attention is None or dropout or (grad and not flex_backward(device)):
            raise ValueError("FlexAttention needs torch >= 2.5 and no dropout, and on CPU no gradients")
        ctx.block_mask = _causal_block_mask(T, device)
        if ctx.table is None and grad and any(p.requires_grad for p in scheme.parameters()):
            ctx.table = scheme.pair_bias(pos, pos, dtype)  # (H, T, T): a learned bias of i and j (FIRE), indexed once
        if ctx.table is not None and ctx.table._base is not None:  # a view's gradient does not reach its base
            ctx.table = ctx.table.clone()  # through Flex's backward (torch 2.13): Flex gets a tensor of its own
        ctx.score_mod = _flex_score_mod(scheme, pos, ctx.table)
        ctx.kernel_options = flex_kernel_options(device, ctx.table)
    elif kernel == "folded":
        if not scheme.key_only_bias:
            raise ValueError(f"the folded kernel needs a key-only bias; {type(scheme).__name__}.key_only_bias is False")
        ctx.blocks = [(s, min(T, s + FOLD_QUERIES)) for s in range(0, T, FOLD_QUERIES)]
        heads, zero = torch.arange(n_head, device=device)[:, None], torch.zeros((), dtype=dtype, device=device)
        ctx.key_bias = []
        for s, e in ctx.blocks:  # the bias of keys 0…e−1 against the block's middle query: (H, e)
            middle = pos[(s + e - 1) // 2]
            ctx.key_bias.append(scheme.score_mod(zero, heads, middle, pos[None, :e]).to(dtype).expand(n_head, e))
        if len(ctx.blocks) > 1 and (grad or dropout or _flash_cpu is None):
            Q = FOLD_QUERIES
            ctx.fold_mask = torch.zeros(Q, T + Q, dtype=dtype, device=device)  # (Q, T+Q)
            ctx.fold_mask[:, T:] = torch.full((Q, Q), float("-inf"), dtype=dtype, device=device).triu(1)
    elif kernel == "banded":
        if _flash_cpu is None or not (scheme.distance_table or scheme.translation_invariant) or not _increasing(pos, span):
            raise ValueError("the banded kernel needs torch's fused CPU attention, a bias of i − j alone "
                             "(distance_table or translation_invariant) and increasing positions")
        ctx.blocks = [(s, min(T, s + FOLD_QUERIES)) for s in range(0, T, FOLD_QUERIES)]
        ctx.far = scheme.far_distance if scheme.far_constant else T  # (T: no key is far)
        if scheme.far_constant:
            far = torch.tensor([ctx.far], device=device)
            ctx.far_bias = scheme.pair_bias(far, torch.zeros_like(far), ctx.table.dtype)[:, 0, 0]  # (H,): distance D
        if span == T or int(pos[-1] - pos[0]) == T - 1:  # 0…T−1 plus an offset: one pattern serves every block
            ctx.masks = [_banded_pattern(ctx.table, min(FOLD_QUERIES, T), ctx.far, dtype)]
    elif kernel == "dense":
        ctx.blocks = _dense_blocks(T, n_head)
        if n_head * T * T <= BIAS_ELEMENTS:  # the whole mask fits the budget: build it once for all layers
            ctx.masks = [dense_mask(scheme, pos, n_head, s, e, dtype, ctx.table) for s, e in ctx.blocks]
    return ctx


def _increasing(pos: torch.Tensor, span: int | None) -> bool:
    """Whether the positions (T,) increase: known for the model's default ones (``span`` = T), else read."""
    return span == pos.numel() or bool((pos[1:] > pos[:-1]).all())


def flex_backward(device: torch.device) -> bool:
    """Whether FlexAttention has a backward on ``device``: not on CPU (torch refuses inputs that need gradients)."""
    return device.type != "cpu"


def choose_kernel(scheme: PositionalScheme, device: torch.device, dtype: torch.dtype, dropout: float,
                  grad: bool) -> str:
    """The kernel the module docstring describes for ``scheme`` on ``device`` with activations in ``dtype``,
    this attention dropout, and gradients on (``grad``) or off."""
    if scheme.contextual:
        return "contextual"
    if not scheme.has_bias:
        return "causal"
    flex = flex_attention is not None and not dropout
    if device.type == "cuda" and flex:
        return "flex"
    wide, relative = dtype in (torch.float32, torch.float64), scheme.distance_table or scheme.translation_invariant
    if device.type == "cpu" and relative and not grad and not dropout and wide and _flash_cpu is not None:
        return "banded"
    if device.type == "cpu" and scheme.key_only_bias and wide:
        return "folded"  # (an 8-bit mantissa would round a folded bias of 64 by 0.25)
    if device.type == "cpu" and flex and not grad and _flex_cpu_works:
        return "flex"
    return "dense"


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Context) -> torch.Tensor:
    """softmax(q·kᵀ/√Dh + bias, keys after the query masked) · v with the kernel of ``ctx``.

    q, k, v: (B, H, T, Dh), q and k already rotated where the scheme rotates → (B, H, T, Dh).
    """
    if ctx.kernel == "causal":
        return F.scaled_dot_product_attention(q, k, v, dropout_p=ctx.dropout, is_causal=True)  # (B, H, T, Dh)
    if ctx.kernel == "folded":
        return _folded(q, k, v, ctx)
    if ctx.kernel == "banded":
        return _banded(q, k, v, ctx)
    if ctx.kernel == "flex":
        return _flex_attend(q, k, v, ctx)
    if ctx.kernel == "contextual":
        return _contextual(q, k, v, ctx)
    return _dense(q, k, v, ctx)


# ---- folded: a key-only bias as one extra head dimension -------------------------------------------------


def _folded(q, k, v, ctx: Context) -> torch.Tensor:
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
            y_diag, lse_diag = _flash_cpu(qf[:, :, s:e], kf[:, :, s:e], vf[:, :, s:e], 0.0, True, scale=1.0)
            if s:  # weight of the square = Z_diag / (Z_diag + Z_past) = sigmoid(lse_diag − lse_past), (B, H, e-s)
                y_past, lse_past = _flash_cpu(qf[:, :, s:e], kf[:, :, :s], vf[:, :, :s], 0.0, False, scale=1.0)
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


def _banded_pattern(table: torch.Tensor, Q: int, D: int, dtype: torch.dtype) -> torch.Tensor:
    """The near keys' bias and causal mask of a query block at positions 0…T−1 plus an offset, rows reversed, as a
    view of one (H, 2Q + D − 2) tensor: (H, Q, Q + D − 1), row Q − 1 − r (query s + r) against column c (key
    s − D + 1 + c) holding the bias of distance r + D − 1 − c, −inf for a later key. (Reversed rows make it a
    sliding window, ``unfold``, with no copy.)"""
    x = torch.arange(-(Q - 1), D, device=table.device)  # c − r of the rows and columns
    near = table[:, (D - 1 - x).clamp(0, table.shape[-1] - 1)].to(dtype)  # (H, Q + D - 1)
    later = torch.full((table.shape[0], Q - 1), float("-inf"), dtype=dtype, device=table.device)  # c − r ≥ D
    return torch.cat((near, later), dim=1).unfold(1, Q + D - 1, 1)  # (H, Q, Q + D - 1)


def _banded(q, k, v, ctx: Context) -> torch.Tensor:
    """Per query block [s, e): the near keys (the table's bias, causal) and, for a far_constant scheme, the far keys
    0…s − D (bias c_h, unmasked), merged by their log-sum-exps (module docstring)."""
    D, H = ctx.far, q.shape[1]
    y = torch.empty_like(q)  # (B, H, T, Dh)
    for s, e in ctx.blocks:
        a = max(0, s - D + 1)  # the first near key
        if ctx.masks:  # the pattern's rows reversed: the block's queries go in reversed, come out reversed back
            Q, first = ctx.masks[0].shape[1], a - (s - D + 1)  # key j is column j − (s − D + 1)
            mask, qb = ctx.masks[0][:, Q - (e - s):, first: first + e - a], q[:, :, s:e].flip(2)  # (H, e-s, e-a)
        else:
            mask, qb = dense_mask(ctx.scheme, ctx.pos, H, s, e, q.dtype, ctx.table)[:, :, a:], q[:, :, s:e]
        yb, lse = _flash_cpu(qb, k[:, :, a:e], v[:, :, a:e], 0.0, False, attn_mask=mask[None])  # (B, H, e-s, Dh)
        if a:  # the far keys: weight of the near ones = sigmoid(lse_near − lse_far − c_h)
            y_far, lse_far = _flash_cpu(qb, k[:, :, :a], v[:, :, :a], 0.0, False)  # (B, H, e-s, Dh), (B, H, e-s)
            w = torch.sigmoid(lse - lse_far - ctx.far_bias[:, None].to(lse.dtype))  # (B, H, e-s)
            yb = torch.lerp(y_far, yb, w[..., None].to(yb.dtype))
        y[:, :, s:e] = yb.flip(2) if ctx.masks else yb
    return y  # (B, H, T, Dh)


# ---- dense: bias + causal mask, one block of queries at a time -------------------------------------------


def _dense_blocks(T: int, n_head: int) -> list[tuple[int, int]]:
    """Query blocks (start, end) whose bias (H, end − start, ≤ T) fits in :data:`BIAS_ELEMENTS`."""
    per_block = max(1, BIAS_ELEMENTS // (n_head * T))
    return [(s, min(T, s + per_block)) for s in range(0, T, per_block)]


def distance_table(scheme: PositionalScheme, pos: torch.Tensor, dtype: torch.dtype,
                   span: int | None = None) -> torch.Tensor:
    """The bias of a ``distance_table`` scheme at every distance n = 0…N−1 a window at positions ``pos`` (T,) int64
    holds, N = ``span`` or max(pos) − min(pos) + 1: ``scheme.pair_bias`` of queries at n against a key at 0 → (H, N), in
    ``dtype`` or float32 if wider (its gradient reaches the scheme's parameters through autograd, outside any
    kernel)."""
    n = torch.arange(span or int(pos.max() - pos.min()) + 1, device=pos.device)  # (N,)
    return scheme.pair_bias(n, n[:1], torch.promote_types(dtype, torch.float32))[:, :, 0]  # (H, N)


def _distances(table: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """i − j of broadcastable int positions, future keys (negative) as 0: the table's column (the mask hides them)."""
    return (q_pos - k_pos).clamp(0, table.shape[-1] - 1)


def dense_mask(scheme: PositionalScheme, pos: torch.Tensor, n_head: int, s: int, e: int,
               dtype: torch.dtype, table: torch.Tensor | None = None) -> torch.Tensor:
    """Bias plus causal mask of queries s…e−1 against keys 0…e−1: (H, e − s, e) in ``dtype``, −inf where the
    key comes after the query (by index). The bias is ``scheme.pair_bias`` of those positions, or, for a
    ``distance_table`` scheme, its :func:`distance_table` (``table``, or built here) indexed by i − j."""
    if scheme.distance_table:
        table = distance_table(scheme, pos, dtype) if table is None else table  # (H, N)
        bias = table[:, _distances(table, pos[s:e, None], pos[None, :e])]  # (H, e-s, e)
    else:
        bias = scheme.pair_bias(pos[s:e], pos[:e], dtype)  # (H, e-s, e)
    future = torch.arange(e, device=pos.device)[None, :] > torch.arange(s, e, device=pos.device)[:, None]  # (e-s, e)
    return bias.masked_fill(future, float("-inf")).to(dtype).expand(n_head, e - s, e)


def _dense(q, k, v, ctx: Context) -> torch.Tensor:
    """SDPA with a float mask per query block: the context's masks, or each block's built here."""
    H, T = q.shape[1], q.shape[2]
    out = []
    for i, (s, e) in enumerate(ctx.blocks if ctx.kernel == "dense" else _dense_blocks(T, H)):
        table = ctx.table if ctx.scheme.distance_table else None  # (a flex context's (H, T, T) bias is not one)
        mask = ctx.masks[i] if ctx.masks else dense_mask(ctx.scheme, ctx.pos, H, s, e, q.dtype, table)  # (H, e-s, e)
        out.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e], dropout_p=ctx.dropout,
                                                  attn_mask=mask.to(q.dtype)[None]))  # (B, H, e-s, Dh)
        # (a 4-D mask: SDPA's fused CPU kernel refuses a 3-D one and falls back to materialising the scores)
    return torch.cat(out, dim=2)  # (B, H, T, Dh)


# ---- contextual: a bias the scheme computes from the queries and their scores, one block of queries at a time -----


def contextual_blocks(B: int, H: int, T: int, device: str = "cpu") -> list[tuple[int, int]]:
    """Query blocks (start, end) whose scores (B, H, end − start, ≤ T) fit in :data:`CONTEXT_ELEMENTS`
    (:data:`CONTEXT_ELEMENTS_CUDA` when ``device`` is ``cuda``)."""
    budget = CONTEXT_ELEMENTS_CUDA if device == "cuda" else CONTEXT_ELEMENTS
    per_block = max(1, budget // (B * H * T))
    return [(s, min(T, s + per_block)) for s in range(0, T, per_block)]


def _contextual(q, k, v, ctx: Context) -> torch.Tensor:
    """softmax(q·kᵀ/√Dh + ``ctx.scheme.contextual_bias``, later keys masked) · v, per query block [s, e) against
    keys 0…e−1 (:func:`_contextual_block`)."""
    B, H, T, Dh = q.shape
    out = [_contextual_block(q[:, :, s:e], k[:, :, :e], v[:, :, :e], s, ctx) for s, e in contextual_blocks(B, H, T, q.device.type)]
    return torch.cat(out, dim=2)  # (B, H, T, Dh)


def _contextual_block(q, k, v, s: int, ctx: Context) -> torch.Tensor:
    """Queries s…s+Q−1, q (B, H, Q, Dh), against keys 0…K−1, k and v (B, H, K, Dh) → (B, H, Q, Dh). The scores and
    the softmax are in float32 at least (sums of 16-bit gates would round), the product with v in v's dtype. Its
    block-sized tensors are freed on return, before the next block's are made."""
    Q, K = q.shape[2], k.shape[2]
    future = torch.ones(Q, K, dtype=torch.bool, device=q.device).triu(s + 1)  # (Q, K): key j after query s + a
    scores = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32))  # (B, H, Q, K)
    scores.mul_(1.0 / math.sqrt(q.shape[-1])).masked_fill_(future, float("-inf"))  # (in place: nothing saved here)
    probs = (scores + ctx.scheme.contextual_bias(q, scores)).softmax(-1)  # (B, H, Q, K)
    if ctx.dropout:
        probs = F.dropout(probs, ctx.dropout)
    return probs.to(v.dtype) @ v  # (B, H, Q, Dh)


# ---- flex: FlexAttention, compiled once ------------------------------------------------------------------

_compiled_flex = None
_compile_callbacks = torch._dynamo.callback.callback_handler  # Dynamo's compile-start hooks (:func:`_run_flex`)
_block_masks: dict[tuple[int, str], object] = {}
FLEX_TABLE_OPTIONS = {"num_stages": 2}  # CUDA, a score_mod reading a table (:func:`flex_kernel_options`)
FLEX_VARIANTS = 64  # Dynamo's cache entries allowed for flex_attention in a process (its default, 8, is 2–3 schemes)


def _flex_score_mod(scheme: PositionalScheme, pos: torch.Tensor, table: torch.Tensor | None):
    """The score_mod of a flex context, Flex's signature (score, b, h, q_idx, kv_idx), positions ``pos`` (T,) looked
    up from the indices: ``table`` (H, N) indexed by i − j, or (H, T, T) by the indices; without one, the scheme's
    own pointwise ``score_mod``. A table's score_mod captures tensors only, so a new model or layer with the same
    shapes reuses the compiled kernel."""
    if table is None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return scheme.score_mod(score, h, pos[q_idx], pos[kv_idx]).to(score.dtype)
    elif table.dim() == 2:
        def score_mod(score, b, h, q_idx, kv_idx):  # the bias of distance i − j
            return score + table[h, _distances(table, pos[q_idx], pos[kv_idx])].to(score.dtype)
    else:
        def score_mod(score, b, h, q_idx, kv_idx):  # the bias of query q_idx and key kv_idx
            return score + table[h, q_idx, kv_idx].to(score.dtype)
    return score_mod


def flex_kernel_options(device: torch.device, table: torch.Tensor | None) -> dict | None:
    """Triton options for Flex's kernels: :data:`FLEX_TABLE_OPTIONS` on CUDA when the score_mod reads a ``table``
    (the first H100 run: Inductor's default three pipeline stages, with the table's loads fused in, asked for 240 KiB
    of shared memory where the device has 227 KiB, and no configuration compiled), else Inductor's defaults (None)."""
    return FLEX_TABLE_OPTIONS if device.type == "cuda" and table is not None else None


def reset_compiled() -> None:
    """Drop every compiled kernel and cached BlockMask of this process (Dynamo's caches included): between two jobs
    of one process (a sweep without joblib, a joblib worker), so that the next job compiles for itself."""
    torch._dynamo.reset()
    _block_masks.clear()


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _causal_block_mask(T: int, device: torch.device):
    """The causal BlockMask of length T on ``device`` (by index), built once per (T, device)."""
    key = (T, str(device))
    if key not in _block_masks:
        _block_masks[key] = create_block_mask(_causal, None, None, T, T, device=device)
    return _block_masks[key]


def _flex_attend(q, k, v, ctx: Context) -> torch.Tensor:
    """Compiled flex_attention (its eager form materialises the scores); on a CPU where it fails to compile,
    the dense kernel, from then on."""
    global _compiled_flex, _flex_cpu_works
    if torch.compiler.is_compiling():  # inside a compiled model (train.compile): its compile covers Flex, whole
        return flex_attention(q, k, v, score_mod=ctx.score_mod, block_mask=ctx.block_mask,
                    kernel_options=ctx.kernel_options)  # (B, H, T, Dh)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    if q.device.type != "cpu":
        return _run_flex(q, k, v, ctx)  # (B, H, T, Dh)
    if _flex_cpu_works:
        try:
            return _run_flex(q, k, v, ctx)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            raise
        except Exception as err:  # noqa: BLE001 - any compiler failure: fall back, once, with the reason
            _flex_cpu_works = False
            log.warning("FlexAttention does not compile on this CPU (%s: %s); using the dense attention kernel",
                        type(err).__name__, str(err).splitlines()[0] if str(err) else "")
    return _dense(q, k, v, ctx)


def _run_flex(q, k, v, ctx: Context) -> torch.Tensor:
    """The compiled flex_attention call, under a recompile limit of :data:`FLEX_VARIANTS` that raises when reached:
    past Dynamo's limit it would run Flex's eager form, which materialises every (B, H, T, T) score. When Dynamo
    compiles in this call (a new shape: seconds on a CPU), "compiling the attention kernel for length T" is logged
    as the compilation starts (Dynamo's compile-start callback), once per call."""
    said = []

    def compiling(*_):  # (torch passes CallbackArgs; older versions nothing)
        if not said:
            said.append(True)
            log.info("compiling the attention kernel for length %d", q.shape[2])

    _compile_callbacks.register_start_callback(compiling)
    try:
        with torch._dynamo.config.patch(recompile_limit=FLEX_VARIANTS, fail_on_recompile_limit_hit=True):
            return _compiled_flex(q, k, v, score_mod=ctx.score_mod, block_mask=ctx.block_mask,
                        kernel_options=ctx.kernel_options)  # (B, H, T, Dh)
    finally:
        if compiling in _compile_callbacks.start_callbacks:  # (torch._dynamo.reset() clears them)
            _compile_callbacks.remove_start_callback(compiling)
