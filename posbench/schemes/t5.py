"""T5's relative position bias (Raffel et al. 2020): a learned scalar per head and log-bucketed distance; registered
as ``t5``.

With i the query position and j the key position (j ≤ i: the attention's causal mask removes the rest), h a head,
``score_mod`` adds w[bucket(i − j), h]. The bias is not key-only, so on CPU it trains through the dense kernel and
evaluates through FlexAttention (or the dense kernel where Flex does not compile); on CUDA it runs FlexAttention.
Every kernel looks the bias up by i − j in a per-distance table built once per forward pass (``distance_table``).

    from posbench.schemes import build_scheme
    t5 = build_scheme("t5", d_model=128, n_head=4, num_buckets=32, max_distance=128)
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from posbench.schemes.base import PositionalScheme, is_int, register


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


@register("t5")
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
    distance_table = True  # the kernels look the bias up by i − j in an (H, N) table built once per forward pass
    far_constant = True  # every distance from max_distance on shares the last bucket (:attr:`far_distance`)
    # Not decayed: the table is B·H scalars that *are* the positional prior (like ALiBi's slopes, not a weight
    # matrix); decay would pull every distance towards a flat bias. T5 itself trained with AdaFactor, no decay.
    weight_decay = False

    @dataclasses.dataclass
    class Config(PositionalScheme.Config):
        """num_buckets: B, buckets of distance (T5: 32); an int >= 2.
        max_distance: the distance from which all share the last bucket (T5: 128); an int > num_buckets // 2."""

        num_buckets: int = 32
        max_distance: int = 128

        def check(self, longest: int | None = None) -> None:
            if not is_int(self.num_buckets) or self.num_buckets < 2:
                raise ValueError(f"num_buckets={self.num_buckets!r}: T5 needs an integer number of buckets >= 2")
            if not is_int(self.max_distance) or self.max_distance <= self.num_buckets // 2:
                raise ValueError(f"max_distance={self.max_distance!r}: must be an integer > num_buckets // 2 = "
                                 f"{self.num_buckets // 2} (the distances with a bucket of their own)")

    def __init__(self, d_model, n_head, config=None, head_dim=None):
        super().__init__(d_model, n_head, config, head_dim)
        B, M = self.config.num_buckets, self.config.max_distance
        self.weight = nn.Parameter(torch.randn(B, n_head) * d_model ** -0.5)  # (B, H)
        buckets = torch.tensor([t5_bucket(n, B, M) for n in range(M + 1)])  # (M + 1,) int64: bucket of distance n
        self.register_buffer("buckets", buckets, persistent=False)

    @property
    def far_distance(self) -> int:
        """D: every distance n ≥ D has the bias of D (the last bucket; :func:`t5_bucket`)."""
        return self.config.max_distance

    def score_mod(self, score, h, q_pos, k_pos):
        n = (q_pos - k_pos).clamp(0, self.config.max_distance)  # distance i − j, future keys as 0; (…) int
        return score + self.weight[self.buckets[n], h]  # (H, Tq, Tk) dense; 0-d under Flex
