"""FlexAttention (``torch.nn.attention.flex_attention``, PyTorch ≥ 2.5; Dong et al. 2024, arXiv:2412.05496) for the
attention module's ``flex`` kernel: the score_mod of a scheme or of its bias table, the causal BlockMask, Triton
options, and one compiled flex_attention per process under a recompile limit that raises.

    score_mod = flex.score_mod(scheme, pos, table)            # pos (T,) int64; table (H, N), (H, T, T) or None
    y = flex.run(q, k, v, score_mod, flex.causal_block_mask(T, q.device), flex.kernel_options(q.device, table))

A local layer's window (posbench/windows.py) is a mask_mod ANDed with the causal one, and its BlockMask skips the
blocks outside it (:func:`block_mask`). A learned sink logit per head needs the log-sum-exp of each query's scores
(``run(..., lse=True)``), which Flex returns and differentiates through (PyTorch ≥ 2.5).

Compiled with automatic dynamic shapes: the second length compiles a dynamic kernel that most later lengths reuse,
and each compilation is logged ("compiling the attention kernel for length T"). Past :data:`VARIANTS` compiled
variants in a process it raises rather than fall back to Flex's eager form, which materialises every score;
:func:`reset_compiled` between jobs of one process.
"""

from __future__ import annotations

import logging

import torch

from posbench.blockwise import distances
from posbench.schemes.base import PositionalScheme
from posbench.windows import Window

log = logging.getLogger("posbench")

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch < 2.5
    flex_attention = create_block_mask = None
try:  # the log-sum-exp asked for as an auxiliary output (torch ≥ 2.9; ``return_lse`` before, deprecated since)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:
    AuxRequest = None

TABLE_OPTIONS = {"num_stages": 2}  # CUDA, a score_mod reading a table (:func:`kernel_options`)
VARIANTS = 64  # Dynamo's cache entries allowed for flex_attention in a process (its default, 8, is 2–3 schemes)
_compiled = None
_compile_callbacks = torch._dynamo.callback.callback_handler  # Dynamo's compile-start hooks (:func:`run`)
_block_masks: dict[tuple, object] = {}


def score_mod(scheme: PositionalScheme, pos: torch.Tensor, table: torch.Tensor | None):
    """The score_mod with Flex's signature (score, b, h, q_idx, kv_idx), positions ``pos`` (T,) looked up from the
    indices: ``table`` (H, N) indexed by i − j, or (H, T, T) by the indices; without one, the scheme's own pointwise
    ``score_mod``. A table's score_mod captures tensors only, so a new model or layer with the same shapes reuses the
    compiled kernel."""
    if table is None:
        def mod(score, b, h, q_idx, kv_idx):
            return scheme.score_mod(score, h, pos[q_idx], pos[kv_idx]).to(score.dtype)
    elif table.dim() == 2:
        def mod(score, b, h, q_idx, kv_idx):  # the bias of distance i − j
            return score + table[h, distances(table, pos[q_idx], pos[kv_idx])].to(score.dtype)
    else:
        def mod(score, b, h, q_idx, kv_idx):  # the bias of query q_idx and key kv_idx
            return score + table[h, q_idx, kv_idx].to(score.dtype)
    return mod


def kernel_options(device: torch.device, table: torch.Tensor | None) -> dict | None:
    """Triton options for Flex's kernels: :data:`TABLE_OPTIONS` on CUDA when the score_mod reads a ``table`` (the
    first H100 run: Inductor's default three pipeline stages, with the table's loads fused in, asked for 240 KiB of
    shared memory where the device has 227 KiB, and no configuration compiled), else Inductor's defaults (None)."""
    return TABLE_OPTIONS if device.type == "cuda" and table is not None else None


CPU_PAD_BELOW, CPU_PAD_TO = 128, 16  # (:func:`cpu_padding`)


def cpu_padding(T: int) -> int:
    """Rows to add after T queries and keys before Flex runs on CPU: up to a multiple of 16 below 128 tokens, else
    0. torch 2.13's compiled CPU kernel returned wrong values (NaN among them), varying from run to run, for T ≡ 8
    (mod 16) below one block of 128 (8, 24, …, 120; measured on an AMD EPYC with AVX2); the other lengths tried were
    right (multiples of 16 among them, and 12, 20, 28, 30, 44, 50, 60, 70, 90, 100, 110, 127), so padding every length
    below 128 to a multiple of 16 takes the failing ones to lengths measured right, whatever the cause. Padded keys
    come after every query, so the causal mask hides them, and padded queries are dropped."""
    return -T % CPU_PAD_TO if T < CPU_PAD_BELOW else 0


def reset_compiled() -> None:
    """Drop every compiled kernel and cached BlockMask of this process (Dynamo's caches included): between two jobs
    of one process (a sweep without joblib, a joblib worker), so that the next job compiles for itself."""
    torch._dynamo.reset()
    _block_masks.clear()


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def causal_block_mask(T: int, device: torch.device):
    """The causal BlockMask of length T on ``device`` (by index), built once per (T, device)."""
    key = (T, str(device))
    if key not in _block_masks:
        _block_masks[key] = create_block_mask(_causal, None, None, T, T, device=device)
    return _block_masks[key]


def block_mask(T: int, device: torch.device, window: Window | None = None):
    """The BlockMask of length T: causal, ANDed with ``window``'s mask (its blocks outside the window skipped), built
    once per (T, device, window); without a window, :func:`causal_block_mask`."""
    if window is None:
        return causal_block_mask(T, device)
    key = (T, str(device), window)
    if key not in _block_masks:
        def mask_mod(b, h, q_idx, kv_idx):
            return window.visible(q_idx, kv_idx)

        _block_masks[key] = create_block_mask(mask_mod, None, None, T, T, device=device)
    return _block_masks[key]


def run(q, k, v, mod, block_mask, options: dict | None, lse: bool = False):
    """flex_attention(q, k, v) with score_mod ``mod``, q, k, v (B, H, T, Dh) → (B, H, T, Dh), and with ``lse`` the
    natural log-sum-exp of each query's scores (B, H, T) too. Inside a compiled model (``train.compile``) the plain
    call, which that compile covers; otherwise the compiled call under a recompile limit of :data:`VARIANTS` that
    raises (``torch._dynamo.exc.FailOnRecompileLimitHit``) when reached. When Dynamo compiles in this call (a new
    shape: seconds on a CPU), "compiling the attention kernel for length T" is logged as the compilation starts
    (Dynamo's compile-start callback), once per call."""
    global _compiled
    extra = ({"return_aux": AuxRequest(lse=True)} if AuxRequest is not None else {"return_lse": True}) if lse else {}
    if torch.compiler.is_compiling():
        return _lse(flex_attention(q, k, v, score_mod=mod, block_mask=block_mask, kernel_options=options, **extra))
    if _compiled is None:
        _compiled = torch.compile(flex_attention)
    said = []

    def compiling(*_):  # (torch passes CallbackArgs; older versions nothing)
        if not said:
            said.append(True)
            log.info("compiling the attention kernel for length %d", q.shape[2])

    _compile_callbacks.register_start_callback(compiling)
    try:
        with torch._dynamo.config.patch(recompile_limit=VARIANTS, fail_on_recompile_limit_hit=True):
            return _lse(_compiled(q, k, v, score_mod=mod, block_mask=block_mask, kernel_options=options, **extra))
    finally:
        if compiling in _compile_callbacks.start_callbacks:  # (torch._dynamo.reset() clears them)
            _compile_callbacks.remove_start_callback(compiling)


def _lse(out):
    """Flex's output as :func:`run` returns it: y, or (y, lse) from either form of asking for the log-sum-exp."""
    if isinstance(out, tuple) and not isinstance(out[1], torch.Tensor):  # (y, AuxOutput)
        return out[0], out[1].lse
    return out
