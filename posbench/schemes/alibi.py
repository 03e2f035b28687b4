"""ALiBi (Press et al. 2022, "Train Short, Test Long"): a bias linear in the distance, −m_h · (i − j), no position
embeddings at all; registered as ``alibi``.

    from posbench.schemes import build_scheme
    alibi = build_scheme("alibi", d_model=128, n_head=4)
"""

from __future__ import annotations

import math

import torch

from posbench.schemes.base import PositionalScheme, register


def alibi_slopes(n_head: int) -> list[float]:
    """ALiBi head slopes, Press et al. 2022, §3 and the paper's ``get_slopes``.

    For n a power of two: the geometric sequence m_h = 2^(−8h/n), h = 1…n (for 8 heads 1/2 … 1/256).
    Otherwise, with p = 2^⌊log2 n⌋: the p slopes for p heads, then every other slope of the sequence
    for 2p heads, taken from the start, until n slopes are had. Raises ValueError when n_head < 1.
    """
    if n_head < 1:
        raise ValueError(f"n_head must be >= 1, got {n_head}")

    def geometric(n):  # n a power of two
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    p = 2 ** int(math.floor(math.log2(n_head)))
    if p == n_head:
        return geometric(n_head)
    return geometric(p) + alibi_slopes(2 * p)[0::2][: n_head - p]


@register("alibi")
class ALiBi(PositionalScheme):
    """Attention with Linear Biases, Press et al. 2022, §3: score(i, j) += −m_h · (i − j) for keys j ≤ i.

    Slopes m_h from :func:`alibi_slopes`; no options. The bias is linear in i − j, so it is key-only up to a
    per-query constant (``key_only_bias``): −m_h·(i − j) = −m_h·(c − j) − m_h·(i − c).
    """

    has_bias = True
    key_only_bias = True
    translation_invariant = True  # −m·(i − j): CPU evaluation runs banded (a mask per distance), training folded

    def __init__(self, d_model, n_head, config=None, head_dim=None):
        super().__init__(d_model, n_head, config, head_dim)
        self.register_buffer("slopes", torch.tensor(alibi_slopes(n_head)), persistent=False)  # (H,)

    def score_mod(self, score, h, q_pos, k_pos):
        return score - self.slopes[h] * (q_pos - k_pos)  # slope (float32) × integer distance: exact for 2^-k slopes
