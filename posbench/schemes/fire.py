"""FIRE (Li et al. 2024): a learned MLP of the log-distance over the log query position, "functional interpolation
for relative positions"; registered as ``fire``.

With i the query position and j the key position (j ≤ i: the attention's causal mask removes the rest), h a head,
``score_mod`` adds the MLP's output for head h, its hidden layer unrolled in Python (a sum of ``mlp_width`` pointwise
terms) for FlexAttention's 0-d calls; ``pair_bias`` computes the same bias for blocks of (query, key) pairs as
matmuls, for the dense kernel and for the (H, T, T) table through which Flex trains it (one indexing op). The bias
depends on i, not only on i − j, except below the threshold L_thr, where every query has the normaliser ψ(L_thr)
(``invariant_below_limit``): CPU evaluation of a window within it runs from a table per distance, as T5's. Its
parameters are initialised here (the model does not re-initialise ``scheme.*``). As its reference code, FIRE is built
once per attention layer with its threshold starting at 512 (``per_layer=true``, ``threshold=512``); ``per_layer=false
threshold=null`` is posbench's earlier FIRE (one for every layer, the threshold starting at the train length L), bit
for bit.

    from posbench.schemes import build_scheme
    fire = build_scheme("fire", d_model=128, n_head=4)                                  # one layer's FIRE
    shared = build_scheme("fire", d_model=128, n_head=4, per_layer=False, threshold=128)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from posbench.schemes.base import PositionalScheme, check_per_layer, is_int, is_number, register

REFERENCE_INIT_L = 512  # the reference code's FIRE(..., init_L=512.0): the default L₀


@register("fire")
class Fire(PositionalScheme):
    """FIRE, Li et al. 2024 ("Functional Interpolation for Relative Positions Improves Long Context
    Transformers", ICLR; arXiv:2310.04418), §3: the final bias, progressive interpolation with the log
    transform ψ and the learned threshold L_thr:

        b(i, j) = f_θ(ψ(i − j) / ψ(max(L_thr, i))),   ψ(x) = log(c·x + 1),

    f_θ: an MLP 1 → ``mlp_width`` (ReLU) → H, one output per head; c and the threshold L_thr learned. As the
    paper's code (its appendix): ψ takes |c·x| (so any c works), the normaliser gets + 1e-6, and L_thr is
    |m·L₀| with a learned multiplier m (init 1) and L₀ fixed — here the ``threshold`` option: by default
    :data:`REFERENCE_INIT_L` = 512, the default ``init_L`` of the reference code (mcleish7/arithmetic,
    ``cramming/architectures/embeddings.py``, ``FIRE(..., init_L=512.0)``); null resolves to the train length L.
    c starts at ``init_c`` (0.1, the paper's); the MLP has PyTorch's default Linear initialisation, as the paper's
    code. i is the query's position as the model gives it (0 … T−1 from the window start by default), so the bias
    depends on i as well as on i − j: FIRE is not translation-invariant. The hidden layer is unrolled in
    ``score_mod`` (a sum of ``mlp_width`` pointwise terms) and a matmul in ``pair_bias``. ``per_layer`` (default
    true): the model holds one FIRE per attention layer, each with its own c, L_thr and MLP, as the reference code
    builds one in every attention layer; false shares one across layers, as KERPLE's and T5's reference code do.
    """

    has_bias = True
    invariant_below_limit = True  # queries i ≤ L_thr share the normaliser ψ(L_thr): a bias of i − j alone there
    # Not decayed: the scheme's parameters are c, the threshold multiplier and a 1 → 32 → H MLP of scalar
    # distances; decay would pull c and L_thr towards 0 (a degenerate ψ and normaliser), and the flag is per
    # scheme, not per tensor.
    weight_decay = False
    EPS = 1e-6  # the paper's code: added to the normaliser ψ(max(L_thr, i))
    HIDDEN_ELEMENTS = 1 << 22  # pair_bias(): largest hidden layer (rows · keys · mlp_width floats) built at once without grad

    @dataclasses.dataclass
    class Config(PositionalScheme.Config):
        """mlp_width: hidden units of f_θ (the paper: 32), an int >= 1.
        init_c: the initial c of ψ(x) = log(c·x + 1) (the paper: 0.1), a number > 0.
        threshold: L₀, the initial threshold L_thr, an int >= 1: 512, the reference code's ``init_L``; null resolves
            to the train length L (posbench's earlier default).
        per_layer: one FIRE per attention layer (true, the reference code's) or one shared by every layer."""

        mlp_width: int = 32
        init_c: float = 0.1
        threshold: Optional[int] = REFERENCE_INIT_L
        per_layer: bool = True

        def fill(self, seq_len: int) -> None:
            if self.threshold is None:
                self.threshold = seq_len

        def check(self, longest: int | None = None) -> None:
            if not is_int(self.mlp_width) or self.mlp_width < 1:
                raise ValueError(f"mlp_width={self.mlp_width!r}: FIRE's MLP needs an integer width >= 1")
            if not is_number(self.init_c) or not self.init_c > 0:
                raise ValueError(f"init_c={self.init_c!r}: FIRE's c must start as a number > 0")
            if self.threshold is not None and (not is_int(self.threshold) or self.threshold < 1):
                raise ValueError(f"threshold={self.threshold!r}: FIRE's threshold must be an integer >= 1 "
                                 f"(null: the train length)")
            check_per_layer(self.per_layer, "FIRE")

    def __init__(self, d_model, n_head, config=None):
        super().__init__(d_model, n_head, config)
        if self.config.threshold is None:  # built without the train length (a notebook, a test): the reference's L₀
            self.config = dataclasses.replace(self.config, threshold=REFERENCE_INIT_L)
        self.mlp = nn.Sequential(nn.Linear(1, self.config.mlp_width), nn.ReLU(), nn.Linear(self.config.mlp_width, n_head))
        self.c = nn.Parameter(torch.tensor(float(self.config.init_c)))  # ()
        self.multiplier = nn.Parameter(torch.tensor(1.0))  # (): L_thr = |multiplier · threshold|

    def invariant_limit(self) -> float:
        """L_thr = |multiplier · threshold|, as :meth:`mlp_input` computes it: every query at a position up to it has
        the normaliser ψ(L_thr), so the bias is f_θ(ψ(i − j) / ψ(L_thr)), a function of i − j alone."""
        return float((self.multiplier * self.config.threshold).abs())

    def mlp_input(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """x = ψ(i − j) / ψ(max(L_thr, i)) for broadcastable int positions (0-d under Flex), in the parameters'
        dtype: f_θ's input."""
        c = self.c
        limit = (self.multiplier * self.config.threshold).abs()  # L_thr, ()
        rel = torch.log1p((c * (q_pos - k_pos).to(c.dtype)).abs())  # ψ(i − j)
        norm = torch.log1p((c * torch.maximum(q_pos.to(c.dtype), limit)).abs()) + self.EPS  # ψ(max(L_thr, i))
        return rel / norm

    def score_mod(self, score, h, q_pos, k_pos):
        x = self.mlp_input(q_pos, k_pos)  # (1, Tq, Tk) dense; 0-d under Flex
        w1, b1 = self.mlp[0].weight[:, 0], self.mlp[0].bias  # (W,), (W,)
        w2, b2 = self.mlp[2].weight, self.mlp[2].bias  # (H, W), (H,)
        out = b2[h]  # (H, 1, 1)
        for u in range(w1.shape[0]):  # f_θ(x)[h] = b2[h] + Σ_u W2[h, u]·relu(W1[u]·x + b1[u])
            out = out + w2[h, u] * torch.relu(w1[u] * x + b1[u])  # (H, Tq, Tk)
        return score + out

    def pair_bias(self, q_pos, k_pos, dtype=torch.float32):
        """f_θ(x) for every (query, key) pair as matmuls, (H, Tq, Tk): the same bias as :meth:`score_mod`'s unrolled
        sum up to float rounding (another order of the sum), in far fewer operations; rows in chunks whose hidden
        layer (rows, Tk, W) stays within :data:`HIDDEN_ELEMENTS` floats when no gradient is taken."""
        x = self.mlp_input(q_pos[:, None], k_pos[None, :])  # (Tq, Tk)
        rows = x.shape[0] if torch.is_grad_enabled() else max(1, self.HIDDEN_ELEMENTS // (x.shape[1] * self.config.mlp_width))
        out = [self.mlp(chunk[..., None]).permute(2, 0, 1) for chunk in x.split(rows)]  # (H, rows, Tk) each
        return torch.cat(out, dim=1)  # (H, Tq, Tk)
