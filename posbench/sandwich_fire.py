"""Relative attention biases whose ``score_mod`` is a sum over codes of the positions: Sandwich's inner product of
sinusoidal codes and FIRE's MLP of normalised log-distance, registered as ``sandwich`` and ``fire`` in
``posbench.positional.SCHEMES``. Importing ``posbench`` imports this module, which adds its schemes to the registry.

With i the query position and j the key position (j ≤ i: the attention's causal mask removes the rest), h a head,
each scheme adds a bias b(h, i, j) to the attention score in ``score_mod``:

* ``sandwich``     (Chi et al. 2023)            the inner product of sinusoidal codes of i and j, compressed per head
* ``fire``         (Li et al. 2024, §3)         an MLP of log-distance over log-position (depends on i, not only i − j)

Neither bias is key-only, so they run through the same attention kernels as T5's and KERPLE's
(posbench/t5_kerple.py). Every ``score_mod`` here is pointwise, its sum unrolled in Python (Sandwich's d̄/2
cosines, FIRE's ``mlp_width`` hidden units), so FlexAttention's 0-d calls and the dense kernel's broadcast calls
take the same code. FIRE's parameters are initialised here (the model does not re-initialise ``scheme.*``).

    from posbench.positional import build_scheme
    sandwich = build_scheme("sandwich", d_model=128, n_head=4)
    fire = build_scheme("fire", d_model=128, n_head=4, threshold=128)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from posbench.positional import SCHEMES, PositionalScheme, is_int, is_number


# ---- Sandwich ------------------------------------------------------------------------------------------


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
    weight_decay = False  # no parameters

    @dataclasses.dataclass
    class Config(PositionalScheme.Config):
        """dim: d̄, the width of the sinusoidal codes (an even int >= 2); None: the head width D/H (NeMo's choice)."""

        dim: Optional[int] = None

        def resolve(self, seq_len: int, longest: int) -> None:
            if self.dim is not None and (not is_int(self.dim) or self.dim < 2 or self.dim % 2):
                raise ValueError(f"dim={self.dim!r}: Sandwich needs an even code width >= 2 (or null: the head width)")

    def __init__(self, d_model, n_head, config=None):
        super().__init__(d_model, n_head, config)
        self.config.resolve(0, 0)  # checks only
        dim = self.config.dim or d_model // n_head
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


# ---- FIRE ----------------------------------------------------------------------------------------------


class Fire(PositionalScheme):
    """FIRE, Li et al. 2024 ("Functional Interpolation for Relative Positions Improves Long Context
    Transformers", ICLR; arXiv:2310.04418), §3: the final bias, progressive interpolation with the log
    transform ψ and the learned threshold L_thr:

        b(i, j) = f_θ(ψ(i − j) / ψ(max(L_thr, i))),   ψ(x) = log(c·x + 1),

    f_θ: an MLP 1 → ``mlp_width`` (ReLU) → H, one output per head; c and the threshold L_thr learned. As the
    paper's code (its appendix): ψ takes |c·x| (so any c works), the normaliser gets + 1e-6, and L_thr is
    |m·L₀| with a learned multiplier m (init 1) and L₀ fixed — here the ``threshold`` option, which resolves to
    the train length L, the paper's initialisation (a Config built without ``resolve``, e.g.
    ``build_scheme("fire", D, H)``, gets 512, the default ``init_L`` of the paper's code; ``posbench train`` and
    every model spec always resolve it, so a checkpoint records the value it trained with). c starts at ``init_c`` (0.1, the paper's); the MLP has
    PyTorch's default Linear initialisation, as the paper's code. i is the query's position as the model
    gives it (0 … T−1 from the window start by default), so the bias depends on i as well as on i − j: FIRE is
    not translation-invariant. The hidden layer is unrolled in ``score_mod`` (a sum of ``mlp_width`` pointwise
    terms), so FlexAttention's 0-d calls and the dense kernel run the same code. One FIRE serves every
    layer, as one instance of any scheme does in posbench's model (KERPLE's and T5's reference code share
    theirs across layers too); the paper's code gives each attention layer its own.
    """

    has_bias = True
    # Not decayed: the scheme's parameters are c, the threshold multiplier and a 1 → 32 → H MLP of scalar
    # distances; decay would pull c and L_thr towards 0 (a degenerate ψ and normaliser), and the flag is per
    # scheme, not per tensor.
    weight_decay = False
    EPS = 1e-6  # the paper's code: added to the normaliser ψ(max(L_thr, i))
    UNRESOLVED_THRESHOLD = 512  # L₀ of a Config never resolved (built directly): the paper code's default init_L

    @dataclasses.dataclass
    class Config(PositionalScheme.Config):
        """mlp_width: hidden units of f_θ (the paper: 32), an int >= 1.
        init_c: the initial c of ψ(x) = log(c·x + 1) (the paper: 0.1), a number > 0.
        threshold: L₀, the initial threshold L_thr (the paper: the train length); None resolves to L; an int >= 1."""

        mlp_width: int = 32
        init_c: float = 0.1
        threshold: Optional[int] = None

        def resolve(self, seq_len: int, longest: int) -> None:
            if self.threshold is None:
                self.threshold = seq_len
            if not is_int(self.mlp_width) or self.mlp_width < 1:
                raise ValueError(f"mlp_width={self.mlp_width!r}: FIRE's MLP needs an integer width >= 1")
            if not is_number(self.init_c) or not self.init_c > 0:
                raise ValueError(f"init_c={self.init_c!r}: FIRE's c must start as a number > 0")
            if not is_int(self.threshold) or self.threshold < 1:
                raise ValueError(f"threshold={self.threshold!r}: FIRE's threshold must be an integer >= 1 "
                                 f"(null: the train length)")

    def __init__(self, d_model, n_head, config=None):
        super().__init__(d_model, n_head, config)
        self.config.resolve(self.UNRESOLVED_THRESHOLD, 0)  # checks; an unresolved threshold becomes 512
        self.mlp = nn.Sequential(nn.Linear(1, self.config.mlp_width), nn.ReLU(), nn.Linear(self.config.mlp_width, n_head))
        self.c = nn.Parameter(torch.tensor(float(self.config.init_c)))  # ()
        self.multiplier = nn.Parameter(torch.tensor(1.0))  # (): L_thr = |multiplier · threshold|

    def score_mod(self, score, h, q_pos, k_pos):
        c = self.c
        i = q_pos.to(c.dtype)
        limit = (self.multiplier * self.config.threshold).abs()  # L_thr, ()
        rel = torch.log1p((c * (q_pos - k_pos).to(c.dtype)).abs())  # ψ(i − j): (1, Tq, Tk) dense; 0-d under Flex
        norm = torch.log1p((c * torch.maximum(i, limit)).abs()) + self.EPS  # ψ(max(L_thr, i)): (1, Tq, 1)
        x = rel / norm  # (1, Tq, Tk)
        w1, b1 = self.mlp[0].weight[:, 0], self.mlp[0].bias  # (W,), (W,)
        w2, b2 = self.mlp[2].weight, self.mlp[2].bias  # (H, W), (H,)
        out = b2[h]  # (H, 1, 1)
        for u in range(w1.shape[0]):  # f_θ(x)[h] = b2[h] + Σ_u W2[h, u]·relu(W1[u]·x + b1[u])
            out = out + w2[h, u] * torch.relu(w1[u] * x + b1[u])  # (H, Tq, Tk)
        return score + out


SCHEMES.update({
    "sandwich": Sandwich,
    "fire": Fire,
})
