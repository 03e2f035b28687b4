"""Attention temperatures: the factor ``model.attn_scale`` puts on each query (so on its logits q·k/√Dh) as a function
of the query's index t in the window (n = t + 1 the keys it sees causally). The model multiplies the queries by it
before any kernel (posbench/model/gpt.py ``GPT``), so every kernel runs unchanged.

Two kinds. ``log_n`` and ``ssmax`` change training: the weights are trained with them, and they cannot be added to a
model after it. The zero-shot temperatures (:data:`ZERO_SHOT`) are exactly 1 at every t < L, so a run trained without
them is, within its train length L, the same model with them; ``posbench eval`` applies them to any such run:

    posbench eval run=outputs/<run> model.attn_scale=floor_log        # Llama 4's / Ministral 3's form past L
    factor("log_n_clipped", 2048, scale_length=128)                     # (2048, 1) float64
"""

from __future__ import annotations

import math

import torch

ATTN_SCALES = ("none", "log_n", "ssmax", "floor_log", "floor_log_n", "log_n_clipped")  # model.attn_scale
ZERO_SHOT = ("floor_log", "floor_log_n", "log_n_clipped")  # exactly 1 within L: applicable after training
SCALE_LAYERS = ("all", "global")  # model.scale_layers: every layer, or the G layers of model.layer_pattern (Llama 4)
BETA = 0.1  # β of floor_log and floor_log_n: Llama 4's attn_scale and Ministral 3's llama_4_scaling_beta


def default_length(kind: str, train_length: int) -> int:
    """``model.scale_length`` when none is given: the train length L, but L + 1 for ``floor_log_n`` (⌊n/F⌋ with
    n = t + 1 reaches 1 at t = F − 1, so F = L + 1 is the smallest F that keeps every t < L at 1)."""
    return train_length + 1 if kind == "floor_log_n" else train_length


def first_scaled(kind: str, scale_length: int) -> int:
    """The first query index t whose zero-shot factor is not 1 (``kind`` in :data:`ZERO_SHOT`): F for floor_log
    (⌊t/F⌋ ≥ 1), F − 1 for floor_log_n (⌊(t + 1)/F⌋ ≥ 1), L' for log_n_clipped (ln(t + 1) > ln L'). A factor is 1
    within the train length L exactly when this is ≥ L."""
    return scale_length - 1 if kind == "floor_log_n" else scale_length


def factor(kind: str, T: int, scale_length: int | None = None, beta: float = BETA, device=None) -> torch.Tensor:
    """(T, 1) float64: the factor on the queries t = 0 … T − 1 (n = t + 1), or, for ``ssmax``, ln n (the model
    multiplies it by each head's learned s_h).

    * ``log_n``: ln n / ln L (Chiang & Cholak 2022, arXiv:2202.12172: logits × log n; ÷ log L, so 1 at n = L);
    * ``ssmax``: ln n (Nakanishi 2025, arXiv:2501.19399: softmax(s·ln n · z));
    * ``floor_log``: 1 + β·ln(1 + ⌊t/F⌋) (Ministral 3 in HF transformers: ``get_llama_4_attn_scale``, the position
      over ``original_max_position_embeddings``), F = ``scale_length``;
    * ``floor_log_n``: 1 + β·ln(1 + ⌊n/F⌋) (Llama 4: ``log1p(floor((position + 1) / floor_scale)) · attn_scale + 1``,
      HF transformers' models/llama4; Meta applies it on the NoPE layers);
    * ``log_n_clipped``: max(1, ln n / ln L') (ReRoPE, Su 2023, and Self-Extend, Jin et al. 2024: log-n scaling
      kept at 1 within the train length), L' = ``scale_length``.

    Raises ValueError for ``none`` or an unknown kind, or a ``scale_length`` a kind needs that is missing or too
    small (below 2 where ln L' divides, below 1 for F)."""
    if kind not in ATTN_SCALES or kind == "none":
        raise ValueError(f"attn_scale={kind!r} has no factor; choose one of: {', '.join(ATTN_SCALES[1:])}")
    smallest = 1 if kind.startswith("floor_log") else 2
    if kind != "ssmax" and not (isinstance(scale_length, int) and scale_length >= smallest):
        raise ValueError(f"scale_length={scale_length!r}: attn_scale={kind} needs an int >= {smallest}")
    n = torch.arange(1, T + 1, device=device, dtype=torch.float64)[:, None]  # (T, 1)
    if kind == "ssmax":
        return n.log()
    if kind == "log_n":
        return n.log() / math.log(scale_length)
    if kind == "log_n_clipped":
        return (n.log() / math.log(scale_length)).clamp(min=1.0)
    counted = n - 1 if kind == "floor_log" else n  # t or n
    return 1 + beta * torch.log1p(torch.floor(counted / scale_length))
