"""CoPE (Golovneva et al. 2024): contextual position encoding, positions counted by gates the content sets;
registered as ``cope``.

A query counts the keys between itself and a key with gates σ(q·k), so a key's position depends on the content
between them: not a pointwise ``score_mod``. CoPE sets ``contextual = True``, and posbench/attention/dispatch.py runs it
through its ``contextual`` kernel, which hands each block of queries and its masked scores to
:meth:`CoPE.contextual_bias` and does the rest (softmax, dropout, · v). It reads no absolute positions.

    from posbench.schemes import build_scheme
    cope = build_scheme("cope", d_model=128, n_head=4, npos=129)   # one layer's CoPE
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from posbench.schemes.base import PositionalScheme, check_per_layer, is_int, register

UNFILLED_NPOS = 513  # npos of a Config never filled with L: the authors' example runs, block size 512, + 1


@register("cope")
class CoPE(PositionalScheme):
    """Contextual Position Encoding, Golovneva et al. 2024 ("Contextual Position Encoding: Learning to Count
    What's Important", arXiv:2405.18719, the CoPE formulas). For query i and key j ≤ i (causal by index), Dh the head width:

        g_ij = σ(q_i·k_j / √Dh)                                   the gates
        p_ij = min(Σ_{t=j..i} g_it, npos − 1)                     the positions, clamped (the paper's p_max)
        e[p] = (p − ⌊p⌋)·e[⌈p⌉] + (1 − p + ⌊p⌋)·e[⌊p⌋]           a fractional position's embedding
        score_ij = (q_i·k_j + q_i·e[p_ij]) / √Dh                 the attention logit, scaled as the reference code

    e: a learned table (Dh, ``npos``), one column per integer position, shared by the heads. The paper leaves
    open what the authors' code (``ContextPosSelfAttn`` in github.com/facebookresearch/RAM, projects/cope) fixes,
    and CoPE here follows it:

    * the gate takes the logit already divided by √Dh: σ(q·k/√Dh);
    * q·e[p] is added before the division by √Dh, so it is scaled like q·k (its default, without ``--cope-nodiv``);
    * e is one table (Dh, npos) shared by all heads of a layer, initialised to zeros, so a new CoPE model starts
      as NoPE and learns its positions;
    * ``npos``: default the maximum length + 1 (p_ij ≤ i + 1 ≤ L, so every position of a train window has its
      own row and none is clamped below L); here null resolves to L + 1;
    * one CoPE per attention layer (``per_layer``, default true), each with its own table; false shares one;
    * the gates use the attention's own q and k (no separate key projection, no value gates: its defaults);
    * Adam without weight decay by default, so the table is not decayed (``weight_decay = False``).

    Cost: the gates and their sums are per query and key, so every (query, key) pair of every layer is
    materialised (in blocks of queries, posbench/attention/dispatch.py ``CONTEXT_ELEMENTS``), and training keeps several
    values per pair for backward: CoPE runs as dense attention does, never through a fused kernel.
    """

    contextual = True
    weight_decay = False  # the reference trains with Adam (its default optimizer): no decay of the table

    @dataclasses.dataclass
    class Config(PositionalScheme.Config):
        """npos: rows of the position table, positions clamped to npos − 1; an int >= 1, null resolves to the train
            length L + 1 (the reference's default, the block size + 1).
        per_layer: one CoPE, with its own table, per attention layer (true, the reference's) or one shared by
            every layer."""

        npos: Optional[int] = None
        per_layer: bool = True

        def fill(self, seq_len: int) -> None:
            if self.npos is None:
                self.npos = seq_len + 1

        def check(self, longest: int | None = None) -> None:
            if self.npos is not None and (not is_int(self.npos) or self.npos < 1):
                raise ValueError(f"npos={self.npos!r}: CoPE needs an integer number of positions >= 1 "
                                 f"(null: the train length + 1)")
            check_per_layer(self.per_layer, "CoPE")

    def __init__(self, d_model, n_head, config=None, head_dim=None):
        super().__init__(d_model, n_head, config, head_dim)
        if self.config.npos is None:  # built without the train length (a notebook, a test)
            self.config = dataclasses.replace(self.config, npos=UNFILLED_NPOS)
        self.table = nn.Parameter(torch.zeros(self.head_dim, self.config.npos))  # (Dh, npos): e[p] = column p

    def contextual_bias(self, q: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """q: (B, H, Q, Dh) a block of queries, scores: (B, H, Q, K) their q·k/√Dh, −inf on future keys, in float32
        or float64 → (B, H, Q, K) q_i·e[p_ij]/√Dh (see the class docstring), finite everywhere (on future keys p is 0).

        The interpolation is computed as e[⌊p⌋] + (p − ⌊p⌋)·(e[⌊p⌋ + 1] − e[⌊p⌋]), one index tensor for both terms: the
        paper's, since ⌈p⌉ = ⌊p⌋ + 1 wherever p − ⌊p⌋ > 0 (at the clamp, p = npos − 1, the weight is 0)."""
        # p_ij = Σ_{t=j..K−1} g_it, summed from the last key: = Σ_{t=j..i} g_it, as g_it = σ(−inf) = 0 for t > i
        p = torch.sigmoid(scores).flip(-1).cumsum(-1).flip(-1).clamp(max=self.table.shape[1] - 1)  # (B, H, Q, K)
        fixed = (q @ self.table.to(q.dtype)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, Q, npos): q·e[n]/√Dh
        step = F.pad(fixed.diff(dim=-1), (0, 1))  # (B, H, Q, npos): q·(e[n+1] − e[n])/√Dh, 0 after the last row
        index = p.floor().long()  # (B, H, Q, K) ⌊p⌋, no gradient
        return fixed.gather(-1, index) + (p - index) * step.gather(-1, index)  # (B, H, Q, K)
