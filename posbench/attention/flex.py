"""FlexAttention (``torch.nn.attention.flex_attention``, PyTorch ≥ 2.5; Dong et al. 2024, arXiv:2412.05496) for the
attention module's ``flex`` kernel: the score_mod of a scheme or of its bias table, the causal BlockMask, Triton
options, and one compiled flex_attention per process under a recompile limit that raises.

    score_mod = flex.score_mod(scheme, pos, table)            # pos (T,) int64; table (H, N), (H, T, T) or None
    y = flex.run(q, k, v, score_mod, flex.causal_block_mask(T, q.device), flex.kernel_options(q.device, table, q.dtype))

Settings a GPU probe measures live in :data:`OPTIONS` (:class:`Options`): the layout in which a trained per-distance
table reaches the kernel (:func:`layout_table`: ``shared``, ``residue`` or ``pair``; attention.context applies it with
gradients on) and the precision of Flex's float32 matmuls on CUDA (:func:`kernel_options`). Their defaults are what
scripts/gpu_probe.py's first run decided (docs/gpu.md).

A local layer's window (posbench/attention/windows.py) is a mask_mod ANDed with the causal one, and its BlockMask skips the
blocks outside it (:func:`block_mask`). A learned sink logit per head needs the log-sum-exp of each query's scores
(``run(..., lse=True)``), which Flex returns and differentiates through (PyTorch ≥ 2.5).

Compiled with automatic dynamic shapes: the second length compiles a dynamic kernel that most later lengths reuse,
and each compilation is logged ("compiling the attention kernel for length T"). Past :data:`VARIANTS` compiled
variants in a process it raises rather than fall back to Flex's eager form, which materialises every score;
:func:`reset_compiled` between jobs of one process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from posbench.attention.blockwise import distances
from posbench.attention.windows import Window
from posbench.schemes.base import PositionalScheme

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
TABLE_LAYOUTS = ("shared", "residue", "pair")  # how a trained per-distance table reaches Flex (:func:`layout_table`)
RESIDUES = 16  # R, the copies of the table in the ``residue`` layout: query q_idx reads copy q_idx mod R
FLOAT32_PRECISIONS = (None, "ieee", "tf32", "tf32x3")  # Triton's tl.dot input_precision for float32 q, k, v; None: Inductor's


@dataclass
class Options:
    """Flex's settings in this process (:data:`OPTIONS`), each checked when set.

    Attributes:
        table_layout: one of :data:`TABLE_LAYOUTS`, the form in which a per-distance table (H, N) that takes gradients
            (T5 and KERPLE in training) reaches the kernel (:func:`layout_table`); evaluation always reads it
            ``shared``. Default ``pair``, provisionally: the one layout that compiled in scripts/gpu_probe.py's
            standalone Flex call on an H200, where ``shared`` and ``residue`` did not (docs/gpu.md); inside a compiled
            model ``shared`` has compiled, and the two have not been timed there.
        float32_precision: None (Inductor's choice: ``ieee`` under ``torch.backends.cuda.matmul.fp32_precision ==
            "ieee"`` or float32 matmul precision ``highest``, else ``tf32``), or one of ``ieee``, ``tf32``, ``tf32x3``:
            the precision of Flex's tl.dot on CUDA when q, k, v are float32 (Inductor's undocumented kernel option
            ``FLOAT32_PRECISION``; torch/_inductor/kernel/flex/flex_attention.py, ``get_float32_precision``). Default
            ``tf32x3`` (three TF32 products per fp32 one; None on ROCm, where Inductor forces ``ieee``): as accurate
            as SDPA's fp32 kernel and 2–4× faster than IEEE for causal, ALiBi and FIRE scores in
            scripts/gpu_probe.py's run on an H200 (docs/gpu.md). It changes only the q·kᵀ and p·v products, the same
            whatever the score_mod, so it applies to every scheme, in fp32 training too.
    Raises:
        ValueError: a value outside those allowed, naming it and them.
    """

    table_layout: str = "pair"
    float32_precision: str | None = None if torch.version.hip else "tf32x3"  # (ROCm: Inductor forces ieee)

    def __setattr__(self, name, value):
        allowed = {"table_layout": TABLE_LAYOUTS, "float32_precision": FLOAT32_PRECISIONS}.get(name)
        if allowed is not None and value not in allowed:
            raise ValueError(f"flex.Options.{name}={value!r}; choose one of {', '.join(map(repr, allowed))}")
        super().__setattr__(name, value)


OPTIONS = Options()  # read by :func:`kernel_options` and attention.context (replace it, or set its fields)
cpu_compiles = True  # set False (posbench/attention/dispatch.py) when compiled Flex fails on this CPU: dense instead
VARIANTS = 64  # Dynamo's cache entries allowed for flex_attention in a process (its default, 8, is 2–3 schemes)
_compiled = None
_compile_callbacks = torch._dynamo.callback.callback_handler  # Dynamo's compile-start hooks (:func:`run`)
_block_masks: dict[tuple, object] = {}


def layout_table(table: torch.Tensor, pos: torch.Tensor, kind: str) -> torch.Tensor:
    """A per-distance table (H, N) in the form ``kind`` (one of :data:`TABLE_LAYOUTS`) that :func:`score_mod` reads,
    for Flex over positions ``pos`` (T,) int64 (padded ones included). Flex's backward adds each score's gradient to
    the table entry it read, one atomic add per score: into H·N addresses when ``shared``, which many scores hit at
    once (contention). Autograd takes every other layout's gradient back to the (H, N) table.

    * ``shared`` — the table itself (H, N).
    * ``residue`` — R = :data:`RESIDUES` copies (H, R, N) (``repeat``: a copy, whose gradient autograd sums over the
      copies); query q_idx reads copy q_idx mod R, so its atomic adds spread over H·R·N addresses.
    * ``pair`` — the bias of every (query, key) pair (H, T, T), gathered at i − j (FIRE's form in training): one
      address per score, no contention, and H·T² floats.

    Raises ValueError for an unknown ``kind``."""
    if kind == "shared":
        return table  # (H, N)
    if kind == "residue":
        return table[:, None].repeat(1, RESIDUES, 1)  # (H, R, N)
    if kind == "pair":
        return table[:, distances(table, pos[:, None], pos[None, :])]  # (H, T, T)
    raise ValueError(f"unknown table layout {kind!r}; choose one of {', '.join(TABLE_LAYOUTS)}")


def score_mod(scheme: PositionalScheme, pos: torch.Tensor, table: torch.Tensor | None, kind: str = "shared"):
    """The score_mod with Flex's signature (score, b, h, q_idx, kv_idx), positions ``pos`` (T,) looked up from the
    indices: a ``table`` in layout ``kind`` (:func:`layout_table`): ``shared`` (H, N) indexed by i − j, ``residue`` (H, R,
    N) by q_idx mod R and i − j, ``pair`` (H, T, T) by the indices (a 3-dimensional table not ``residue`` is read so
    too: FIRE's in training); without one, the scheme's own pointwise ``score_mod``. A table's score_mod captures
    tensors only, so a new model or layer with the same shapes reuses the compiled kernel. Raises ValueError for an
    unknown ``kind``, or a table whose dimensions do not fit it."""
    if kind not in TABLE_LAYOUTS:
        raise ValueError(f"unknown table layout {kind!r}; choose one of {', '.join(TABLE_LAYOUTS)}")
    if table is not None and table.dim() not in ((2, 3) if kind == "shared" else (3,)):
        raise ValueError(f"a {kind} table of shape {tuple(table.shape)}: it has {'2 or 3' if kind == 'shared' else 3} "
                         "dimensions")
    if table is None:
        def mod(score, b, h, q_idx, kv_idx):
            return scheme.score_mod(score, h, pos[q_idx], pos[kv_idx]).to(score.dtype)
    elif kind == "residue":
        R = table.shape[1]

        def mod(score, b, h, q_idx, kv_idx):  # copy q_idx mod R of the bias of distance i − j
            return score + table[h, q_idx % R, distances(table, pos[q_idx], pos[kv_idx])].to(score.dtype)
    elif table.dim() == 2:
        def mod(score, b, h, q_idx, kv_idx):  # the bias of distance i − j
            return score + table[h, distances(table, pos[q_idx], pos[kv_idx])].to(score.dtype)
    else:
        def mod(score, b, h, q_idx, kv_idx):  # the bias of query q_idx and key kv_idx
            return score + table[h, q_idx, kv_idx].to(score.dtype)
    return mod


def kernel_options(device: torch.device, table: torch.Tensor | None, dtype: torch.dtype | None = None) -> dict | None:
    """Triton options for Flex's kernels on ``device`` with q, k, v in ``dtype``: on CUDA, :data:`TABLE_OPTIONS` when
    the score_mod reads a ``table`` (the first H100 run: Inductor's default three pipeline stages, with the table's
    loads fused in, asked for 240 KiB of shared memory where the device has 227 KiB, and no configuration compiled),
    and with float32 q, k, v and ``OPTIONS.float32_precision`` set, ``FLOAT32_PRECISION`` as the quoted string Inductor
    writes into the Triton source (``"'tf32x3'"``: tl.dot's ``input_precision``); else Inductor's defaults (None).
    A new dict each call."""
    if device.type != "cuda":
        return None
    options = dict(TABLE_OPTIONS) if table is not None else {}
    if dtype == torch.float32 and OPTIONS.float32_precision is not None:
        options["FLOAT32_PRECISION"] = f"'{OPTIONS.float32_precision}'"
    return options or None


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


def causal_kv_blocks(T: int, device: torch.device, block: int = 128) -> tuple[torch.Tensor, ...]:
    """The causal mask of length T in Flex's BlockMask fields, from block indices alone: O(n²) int32 for n = ⌈T/block⌉
    blocks of ``block`` queries × ``block`` keys, no (T, T) mask. A row of ``block`` queries all below T: its diagonal
    block partial (the mask_mod runs there), the blocks left of it full. A last row cut short (T not a multiple of
    ``block``): partial from block 0 to the diagonal, as ``create_block_mask`` has it, which pads the mask with False
    to whole blocks and calls a block full only if every one of its block² entries is True. Each row of indices lists
    its blocks ascending, then the others ascending (``create_block_mask``'s stable argsort), so that every field
    equals create_block_mask's. Returns kv_num_blocks (1, 1, n), kv_indices (1, 1, n, n), full_kv_num_blocks
    (1, 1, n), full_kv_indices (1, 1, n, n), int32 on ``device``."""
    n = -(-T // block)
    i = torch.arange(n, dtype=torch.int32, device=device)[:, None]  # (n, 1) the row of query blocks
    k = torch.arange(n, dtype=torch.int32, device=device)[None, :]  # (1, n) the place in the row
    whole = (i + 1) * block <= T  # (n, 1) every query of the row below T
    num = torch.where(whole, 1, i + 1).to(torch.int32)[:, 0]  # (n,) the partial blocks
    indices = torch.where(whole & (k == 0), i, torch.where(whole & (k <= i), k - 1, k)).to(torch.int32)  # (n, n)
    full_num = torch.where(whole, i, 0).to(torch.int32)[:, 0]  # (n,) blocks 0 … i − 1
    full_indices = k.expand(n, n).contiguous()  # (n, n)
    return num[None, None], indices[None, None], full_num[None, None], full_indices[None, None]


def causal_block_mask(T: int, device: torch.device):
    """The causal BlockMask of length T on ``device`` (by index), built once per (T, device) from block indices
    (:func:`causal_kv_blocks`): equal, field by field, to ``create_block_mask`` of the causal mask_mod, which
    evaluates all T² entries (T = 65,536: 4 Gi booleans)."""
    key = (T, str(device))
    if key not in _block_masks:  # (the module imported with flex_attention above)
        _block_masks[key] = torch.nn.attention.flex_attention.BlockMask.from_kv_blocks(
            *causal_kv_blocks(T, device), BLOCK_SIZE=128, mask_mod=_causal, seq_lengths=(T, T))
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
