"""Sandwich (Chi et al. 2023): a parameter-free bias, the inner product of sinusoidal codes of the query and key
positions, compressed per head as ALiBi's slopes are; registered as ``sandwich``.

With i the query position and j the key position (j ≤ i: the attention's causal mask removes the rest), h a head,
``score_mod`` adds the bias; its sum over the d̄/2 cosines is unrolled in Python. The kernels evaluate it once per
forward pass per distance (``distance_table``) and look it up by i − j. Not key-only: it runs through the same
kernels as T5's.

    from posbench.schemes import build_scheme
    sandwich = build_scheme("sandwich", d_model=128, n_head=4)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from posbench.schemes.base import PositionalScheme, is_int, register


@register("sandwich")
class Sandwich(PositionalScheme):
    """Sandwich, Chi et al. 2023 ("Dissecting Transformer Length Extrapolation via the Lens of Receptive Field
    Analysis", ACL; arXiv:2212.10356), the section introducing Sandwich: the bias is the inner product of the
    sinusoidal position codes of i and j of width d̄ (cross terms with the token embeddings dropped),

        p_iᵀ p_j = Σ_{k=1}^{d̄/2} cos((i − j) / 10000^(2k/d̄)),

    parameter-free, with ALiBi's head-dependent compression: head h = 1 … H divides it by 8h/H (the paper's
    ALiBi notation, Fig. 1: slopes over the range n·8/H, n = 1 … H). As in the paper's released form (NVIDIA
    NeMo's ``SandwichRelativePositionEmbedding``), d̄/2 is subtracted first, so the bias is 0 at i = j and
    negative elsewhere (a per-query constant: softmax is unchanged by it):

        score(i, j) += (Σ_{k=1}^{d̄/2} cos((i − j)·ω_k) − d̄/2) / (8h/H),   ω_k = 10000^(−2k/d̄).

    Translation-invariant. The phases (i − j)·ω_k and the cosines are computed in float64 (fp32 would lose
    ~|i − j|·6e-8 rad a term: 1e-3 at 16k) and the sum cast to the score's dtype; the d̄/2 terms are unrolled.
    """

    has_bias = True
    distance_table = True  # the kernels look the bias up by i − j in an (H, N) table built once per forward pass
    weight_decay = False  # no parameters

    @dataclasses.dataclass
    class Config(PositionalScheme.Config):
        """dim: d̄, the width of the sinusoidal codes (an even int >= 2); None: the head width D/H (NeMo's choice)."""

        dim: Optional[int] = None

        def check(self, longest: int | None = None) -> None:
            if self.dim is not None and (not is_int(self.dim) or self.dim < 2 or self.dim % 2):
                raise ValueError(f"dim={self.dim!r}: Sandwich needs an even code width >= 2 (or null: the head width)")

    def __init__(self, d_model, n_head, config=None, head_dim=None):
        super().__init__(d_model, n_head, config, head_dim)
        dim = self.config.dim or self.head_dim
        if dim < 2 or dim % 2:
            raise ValueError(f"sandwich: the head width {dim} is not an even number >= 2; set scheme.dim")
        self.omegas = [10000.0 ** (-2.0 * k / dim) for k in range(1, dim // 2 + 1)]  # ω_1 … ω_{d̄/2}, floats
        self.half = dim // 2
        compression = torch.tensor([8.0 * h / n_head for h in range(1, n_head + 1)], dtype=torch.float64)  # (H,)
        self.register_buffer("compression", compression, persistent=False)

    def score_mod(self, score, h, q_pos, k_pos):
        d = (q_pos - k_pos).to(torch.float64)  # i − j
        total = torch.cos(d * self.omegas[0])
        for omega in self.omegas[1:]:
            total = total + torch.cos(d * omega)  # (1, Tq, Tk) dense; 0-d under Flex
        return score + ((total - self.half) / self.compression[h]).to(score.dtype)  # (H, Tq, Tk)
