"""KERPLE (Chi et al. 2022): biases from conditionally positive definite kernels of the distance |i − j|, two learned
scalars per head; registered as ``kerple_log`` (−r₁·log(1 + r₂·|i − j|)) and ``kerple_power`` (−r₁·|i − j|^r₂).

With i the query position and j the key position (j ≤ i: the attention's causal mask removes the rest), h a head,
``score_mod`` adds the kernel's bias. Not key-only: on CPU it trains through the dense kernel and evaluates through
FlexAttention; on CUDA it runs FlexAttention. Learned parameters are initialised here (the model does not
re-initialise ``scheme.*``).

    from posbench.schemes import build_scheme
    kerple = build_scheme("kerple_log", d_model=128, n_head=4)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from posbench.schemes.base import PositionalScheme, is_number, register


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """θ with softplus(θ) = y, for y > 0: log(exp(y) − 1)."""
    return torch.log(torch.expm1(y))


class _Kerple(PositionalScheme):
    """KERPLE, Chi et al. 2022 ("KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation",
    NeurIPS), §4 (the conditionally positive definite kernels turned into biases): per head two learned
    r₁, r₂ > 0; the subclasses give the kernel. Translation-invariant: the bias depends on |i − j| only.

    Initialisation as the paper's code (github.com/chijames/KERPLE, ``ParallelKerpleLog`` /
    ``ParallelKerplePower``): each r drawn uniformly from (0, r_max), raised to the code's floor 0.01, which that
    code applies to the parameters in place before every use.

    Positivity without a post-step hook: r is a reparametrisation of an unconstrained parameter θ —
    r₁ = softplus(θ₁) always, r₂ = softplus(θ₂) (log) or 2·sigmoid(θ₂) (power, so 0 < r₂ < 2). The values are
    therefore always in range, in every kernel, with no clamp that could stop a gradient. Consequences: the
    optimiser steps θ, not r (∂r/∂θ = sigmoid(θ) for softplus), so AdamW's per-parameter step, in r, shrinks
    as r nears its bound instead of being cut at the reference's floor 0.01: r may go below 0.01 (never to 0)
    and r₂ of the power kernel never reaches 2 exactly. ``r1()`` and ``r2()`` give the values.
    """

    has_bias = True
    distance_table = True  # the kernels look the bias up by i − j in an (H, N) table built once per forward pass
    # Not decayed: θ = 0 is no prior (it is r = log 2 or r₂ = 1); decay would pull every head's kernel towards
    # an arbitrary one. Four scalars per head (two here) are positional hyperparameters, not capacity.
    weight_decay = False
    R1_MAX, R2_MAX = 2.0, 1.0  # the reference's init ranges: the subclass overrides
    FLOOR = 1e-2  # the reference code's clamp floor, applied to the initial draw

    @dataclasses.dataclass
    class Config(PositionalScheme.Config):
        """r1_max, r2_max: r₁ and r₂ start uniform in (0, r_max) (then at least 0.01); numbers > 0.01.
        None: the reference code's ranges (log: r₁ < 2, r₂ < 1; power: r₁ < 1, r₂ < 2)."""

        r1_max: Optional[float] = None
        r2_max: Optional[float] = None

        def check(self, longest: int | None = None) -> None:
            for name in ("r1_max", "r2_max"):
                value = getattr(self, name)
                if value is not None and (not is_number(value) or not value > _Kerple.FLOOR):
                    raise ValueError(f"{name}={value!r}: KERPLE's initial range needs a number > {_Kerple.FLOOR}")

    def __init__(self, d_model, n_head, config=None, head_dim=None):
        super().__init__(d_model, n_head, config, head_dim)
        r1_max = self.R1_MAX if self.config.r1_max is None else self.config.r1_max
        r2_max = self.R2_MAX if self.config.r2_max is None else self.config.r2_max
        r1 = (torch.rand(n_head, dtype=torch.float64) * r1_max).clamp(min=self.FLOOR)  # (H,)
        r2 = (torch.rand(n_head, dtype=torch.float64) * r2_max).clamp(min=self.FLOOR)  # (H,)
        self.theta1 = nn.Parameter(_inverse_softplus(r1).float())  # (H,)
        self.theta2 = nn.Parameter(self._r2_inverse(r2).float())  # (H,)

    def _r2_inverse(self, r2: torch.Tensor) -> torch.Tensor:
        return _inverse_softplus(r2)

    def r1(self) -> torch.Tensor:
        """(H,) r₁ = softplus(θ₁) > 0."""
        return F.softplus(self.theta1)

    def r2(self) -> torch.Tensor:
        """(H,) r₂ > 0 (the power kernel's also < 2)."""
        return F.softplus(self.theta2)


@register("kerple_log")
class KerpleLog(_Kerple):
    """KERPLE's logarithmic variant, Chi et al. 2022, §4 (the log kernel): score(i, j) += −r₁·log(1 + r₂·|i − j|).

    See :class:`_Kerple` for the shared initialisation and the softplus reparametrisation keeping r₁, r₂ > 0;
    r₁ starts in (0, 2), r₂ in (0, 1), as ``ParallelKerpleLog`` (``bias_p``, ``bias_a``).
    """

    R1_MAX, R2_MAX = 2.0, 1.0

    def score_mod(self, score, h, q_pos, k_pos):
        d = (q_pos - k_pos).abs().to(self.theta1.dtype)  # |i − j|, float
        r1 = F.softplus(self.theta1[h])  # (H, 1, 1) dense; 0-d under Flex
        r2 = F.softplus(self.theta2[h])
        return score - r1 * torch.log1p(r2 * d)  # (H, Tq, Tk)


@register("kerple_power")
class KerplePower(_Kerple):
    """KERPLE's power variant, Chi et al. 2022, §4 (the power kernel): score(i, j) += −r₁·|i − j|^r₂, r₁ > 0,
    0 < r₂ ≤ 2 (the range for which the kernel is conditionally positive definite).

    See :class:`_Kerple`; here r₂ = 2·sigmoid(θ₂) ∈ (0, 2). r₁ starts in (0, 1), r₂ in (0, 2), as
    ``ParallelKerplePower`` (``bias_a``, ``bias_p``), whose clamp keeps r₂ in [0.01, 2].
    """

    R1_MAX, R2_MAX = 1.0, 2.0

    @dataclasses.dataclass
    class Config(_Kerple.Config):
        """r1_max, r2_max: r₁ and r₂ start uniform in (0, r_max) (then at least 0.01); numbers > 0.01, r2_max <= 2
        (the power kernel needs r₂ <= 2). None: the reference code's ranges (r₁ < 1, r₂ < 2)."""

        def check(self, longest: int | None = None) -> None:
            super().check(longest)
            if self.r2_max is not None and self.r2_max > 2:
                raise ValueError(f"r2_max={self.r2_max!r}: the power kernel needs r2 <= 2")

    def _r2_inverse(self, r2):
        half = (r2 / 2).clamp(max=1 - 1e-6)  # r₂ = 2·sigmoid(θ): θ = logit(r₂ / 2); a draw of 2 stays finite
        return torch.log(half) - torch.log1p(-half)

    def r2(self):
        return 2 * torch.sigmoid(self.theta2)

    def score_mod(self, score, h, q_pos, k_pos):
        d = (q_pos - k_pos).abs().to(self.theta1.dtype)  # |i − j|, float
        r1 = F.softplus(self.theta1[h])  # (H, 1, 1) dense; 0-d under Flex
        r2 = 2 * torch.sigmoid(self.theta2[h])
        return score - r1 * d.pow(r2)  # (H, Tq, Tk); 0^r₂ = 0 on the diagonal (torch's d/dr₂ there is 0)
