"""Relative attention biases learned per head as functions of the distance i − j alone: T5's bucketed table and
KERPLE's kernels, registered as ``t5``, ``kerple_log`` and ``kerple_power`` in ``posbench.positional.SCHEMES``.
Importing ``posbench`` imports this module, which adds its schemes to the registry.

With i the query position and j the key position (j ≤ i: the attention's causal mask removes the rest), h a head,
each scheme adds a bias b(h, i, j) to the attention score in ``score_mod``:

* ``t5``           (Raffel et al. 2020, §2.1)   a learned scalar per head and log-bucketed distance i − j
* ``kerple_log``   (Chi et al. 2022, §4)        −r₁·log(1 + r₂·|i − j|), r₁, r₂ > 0 learned per head
* ``kerple_power`` (Chi et al. 2022, §4)        −r₁·|i − j|^r₂, r₁ > 0, 0 < r₂ ≤ 2 learned per head

None of these biases is key-only (``key_only_bias = False``): on CPU they train through the dense kernel and
evaluate through FlexAttention (or the dense kernel where Flex does not compile); on CUDA they run
FlexAttention. Every ``score_mod`` here is pointwise (broadcasting and indexing of small parameter tables only),
so FlexAttention's 0-d calls and the dense kernel's broadcast calls take the same code. Learned parameters are
initialised here (the model does not re-initialise ``scheme.*``). The other relative biases, Sandwich and FIRE,
are in posbench/sandwich_fire.py.

    from posbench.positional import build_scheme
    t5 = build_scheme("t5", d_model=128, n_head=4, num_buckets=32, max_distance=128)
    kerple = build_scheme("kerple_log", d_model=128, n_head=4)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from posbench.positional import SCHEMES, PositionalScheme, is_int, is_number


# ---- T5 ------------------------------------------------------------------------------------------------


def t5_bucket(n: int, num_buckets: int, max_distance: int) -> int:
    """The unidirectional bucket of a distance n = i − j (negative n counts as 0), as in the T5 code
    (mesh-tensorflow's and Hugging Face's ``_relative_position_bucket`` with ``bidirectional=False``):
    exact buckets 0 … B/2 − 1 for n < B/2, then B/2 + ⌊log(n / (B/2)) / log(max_distance / (B/2)) · (B − B/2)⌋,
    capped at B − 1 (every n ≥ max_distance shares the last bucket). Computed in float64 (``math.log``)."""
    n = max(n, 0)
    exact = num_buckets // 2
    if n < exact:
        return n
    large = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return min(large, num_buckets - 1)


class T5Bias(PositionalScheme):
    """T5 relative position bias, Raffel et al. 2020 ("Exploring the Limits of Transfer Learning with a Unified
    Text-to-Text Transformer"), §2.1: score(i, j) += w[bucket(i − j), h], one learned scalar per head and bucket.

    Buckets (the T5 code's causal, unidirectional bucketing; :func:`t5_bucket`): distances 0 … B/2 − 1 get a
    bucket each, larger distances share B/2 logarithmically wider buckets up to ``max_distance``, beyond which
    every distance falls in the last bucket (so the bias is constant past ``max_distance``). One table
    w: (num_buckets, H), shared by all layers (the scheme object is). A distance's bucket is looked up in a
    table of max_distance + 1 entries computed once in float64, so every kernel uses the same integer buckets.
    Translation-invariant: the bias depends on i − j only.

    Initialisation: w ~ N(0, d_model^(−1/2)), Hugging Face's T5 initialisation of ``relative_attention_bias``
    (``T5PreTrainedModel._init_weights``, factor 1).
    """

    has_bias = True
    # Not decayed: the table is B·H scalars that *are* the positional prior (like ALiBi's slopes, not a weight
    # matrix); decay would pull every distance towards a flat bias. T5 itself trained with AdaFactor, no decay.
    weight_decay = False

    @dataclasses.dataclass
    class Config(PositionalScheme.Config):
        """num_buckets: B, buckets of distance (T5: 32); an int >= 2.
        max_distance: the distance from which all share the last bucket (T5: 128); an int > num_buckets // 2."""

        num_buckets: int = 32
        max_distance: int = 128

        def resolve(self, seq_len: int, longest: int) -> None:
            if not is_int(self.num_buckets) or self.num_buckets < 2:
                raise ValueError(f"num_buckets={self.num_buckets!r}: T5 needs an integer number of buckets >= 2")
            if not is_int(self.max_distance) or self.max_distance <= self.num_buckets // 2:
                raise ValueError(f"max_distance={self.max_distance!r}: must be an integer > num_buckets // 2 = "
                                 f"{self.num_buckets // 2} (the distances with a bucket of their own)")

    def __init__(self, d_model, n_head, config=None):
        super().__init__(d_model, n_head, config)
        self.config.resolve(0, 0)  # no derived defaults: checks only, so a bad value fails here too
        B, M = self.config.num_buckets, self.config.max_distance
        self.weight = nn.Parameter(torch.randn(B, n_head) * d_model ** -0.5)  # (B, H)
        buckets = torch.tensor([t5_bucket(n, B, M) for n in range(M + 1)])  # (M + 1,) int64: bucket of distance n
        self.register_buffer("buckets", buckets, persistent=False)

    def score_mod(self, score, h, q_pos, k_pos):
        n = (q_pos - k_pos).clamp(0, self.config.max_distance)  # distance i − j, future keys as 0; (…) int
        return score + self.weight[self.buckets[n], h]  # (H, Tq, Tk) dense; 0-d under Flex


# ---- KERPLE --------------------------------------------------------------------------------------------


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

        def resolve(self, seq_len: int, longest: int) -> None:
            for name in ("r1_max", "r2_max"):
                value = getattr(self, name)
                if value is not None and (not is_number(value) or not value > _Kerple.FLOOR):
                    raise ValueError(f"{name}={value!r}: KERPLE's initial range needs a number > {_Kerple.FLOOR}")

    def __init__(self, d_model, n_head, config=None):
        super().__init__(d_model, n_head, config)
        self.config.resolve(0, 0)  # checks only: a bad value fails here too
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

        def resolve(self, seq_len: int, longest: int) -> None:
            super().resolve(seq_len, longest)
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


SCHEMES.update({
    "t5": T5Bias,
    "kerple_log": KerpleLog,
    "kerple_power": KerplePower,
})
