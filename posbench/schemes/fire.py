"""FIRE (Li et al. 2024): a learned MLP of the log-distance over the log query position, "functional interpolation
for relative positions"; registered as ``fire``.

With i the query position and j the key position (j ≤ i: the attention's causal mask removes the rest), h a head,
``score_mod`` adds the MLP's output for head h. f_θ is a ReLU network of one scalar, so piecewise linear: ``fold``
gives its kinks and each segment's slope and intercept per head, which evaluation uses — ``score_mod`` for
FlexAttention's 0-d calls (``score_mod_mlp``: the hidden layer unrolled, as before), ``pair_bias`` for blocks of
(query, key) pairs (the dense kernel's masks; CPU evaluation past the threshold). With gradients, ``pair_bias`` is the
MLP as matmuls, for the dense kernel and for the (H, T, T) table through which Flex trains it (one indexing op). The bias
depends on i, not only on i − j, except below the threshold L_thr, where every query has the normaliser ψ(L_thr)
(``invariant_below_limit``): CPU evaluation of a window within it runs from a table per distance, as T5's. Its
parameters are initialised here (the model does not re-initialise ``scheme.*``). As its reference code, FIRE is built
once per attention layer with its threshold starting at 512 (``per_layer=true``, ``threshold=512``); ``per_layer=false
threshold=null`` is posbench's earlier FIRE (one for every layer, the threshold starting at the train length L), bit
for bit in training (evaluation's fold differs from the MLP by float rounding).

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
    depends on i as well as on i − j: FIRE is not translation-invariant. Without gradients the bias comes from the
    MLP's piecewise-linear fold (:meth:`fold`); with them from the MLP itself (unrolled in :meth:`score_mod_mlp`, a
    matmul in :meth:`mlp_bias`). ``per_layer`` (default
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
    HIDDEN_ELEMENTS = 1 << 22  # pair_bias() without grad: largest hidden layer (rows · keys · W) or lookup (rows · keys · H)
    FOLD_ROWS = 64  # pair_bias() without grad, consecutive positions: query rows per sheared block

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

    def __init__(self, d_model, n_head, config=None, head_dim=None):
        super().__init__(d_model, n_head, config, head_dim)
        if self.config.threshold is None:  # built without the train length (a notebook, a test): the reference's L₀
            self.config = dataclasses.replace(self.config, threshold=REFERENCE_INIT_L)
        self.mlp = nn.Sequential(nn.Linear(1, self.config.mlp_width), nn.ReLU(), nn.Linear(self.config.mlp_width, n_head))
        self.c = nn.Parameter(torch.tensor(float(self.config.init_c)))  # ()
        self.multiplier = nn.Parameter(torch.tensor(1.0))  # (): L_thr = |multiplier · threshold|
        self._fold_tables = None  # :meth:`rotation`'s fold of this forward pass, which Flex's score_mod reads

    def invariant_limit(self) -> float:
        """L_thr = |multiplier · threshold|, as :meth:`mlp_input` computes it: every query at a position up to it has
        the normaliser ψ(L_thr), so the bias is f_θ(ψ(i − j) / ψ(L_thr)), a function of i − j alone."""
        return float(self.threshold_now())

    def threshold_now(self) -> torch.Tensor:
        """L_thr = |multiplier · threshold|, () in the parameters' dtype: the threshold as trained so far."""
        return (self.multiplier * self.config.threshold).abs()

    @classmethod
    def dense_rows(cls, grad: bool, device: torch.device) -> int | None:
        """:data:`FOLD_ROWS` on CPU without gradients (:meth:`sheared_bias`'s blocks, its fold beating Flex's
        score_mod there), else None."""
        return cls.FOLD_ROWS if not grad and device.type == "cpu" else None

    def mlp_input(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """x = ψ(i − j) / ψ(max(L_thr, i)) for broadcastable int positions (0-d under Flex), in the parameters'
        dtype: f_θ's input."""
        return self.psi(q_pos - k_pos) / self.normaliser(q_pos)

    def psi(self, x: torch.Tensor) -> torch.Tensor:
        """ψ(x) = log(|c·x| + 1) of positions or distances ``x`` (any shape), in the parameters' dtype."""
        return torch.log1p((self.c * x.to(self.c.dtype)).abs())

    def normaliser(self, q_pos: torch.Tensor) -> torch.Tensor:
        """ψ(max(L_thr, i)) + ε of query positions ``q_pos`` (any shape), L_thr = |multiplier · threshold|: the
        denominator of :meth:`mlp_input`."""
        return self.psi(torch.maximum(q_pos.to(self.c.dtype), self.threshold_now())) + self.EPS

    def fold(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """f_θ as the piecewise-linear function it is: sorted kinks (W,), slopes (H, W + 1) and intercepts (H, W + 1),
        in the parameters' dtype, such that f_θ(x)[h] = slopes[h, s]·x + intercepts[h, s] with s = #{u: x > kinks[u]}.

        f_θ(x)[h] = b2[h] + Σ_u W2[h, u]·relu(W1[u]·x + b1[u]) (§3's MLP of one scalar) is linear between the kinks
        x_u = −b1[u]/W1[u]: in segment s (kinks[s−1] < x ≤ kinks[s]) unit u is active when W1[u] > 0 and its kink is
        among the first s, or W1[u] < 0 and it is not, so slopes = Σ_active W2·W1 and intercepts = b2 + Σ_active W2·b1.
        A unit with W1[u] = 0 is the constant relu(b1[u]) (in every intercept; its kink +inf, never passed); equal
        kinks leave empty segments between them, never selected. At a kink both neighbouring segments give the value
        there, so the fold is the MLP up to rounding (another order of the same sums). Computed in float64, then cast:
        differentiable in W2, b2 and (through the segment's active units) W1 and b1, as the MLP is between kinks."""
        w1, b1 = self.mlp[0].weight[:, 0].double(), self.mlp[0].bias.double()  # (W,), (W,)
        w2, b2 = self.mlp[2].weight.double(), self.mlp[2].bias.double()  # (H, W), (H,)
        flat = w1 == 0  # (W,): constant units
        kinks = torch.where(flat, torch.inf, -b1 / torch.where(flat, 1.0, w1))  # (W,)
        kinks, order = torch.sort(kinks.detach(), stable=True)  # (W,), (W,)
        w1, b1, w2, flat = w1[order], b1[order], w2[:, order], flat[order]
        W = w1.shape[0]
        passed = torch.arange(W, device=w1.device)[:, None] < torch.arange(W + 1, device=w1.device)[None, :]  # (W, W+1)
        active = (torch.where(w1[:, None] > 0, passed, ~passed) & ~flat[:, None]).to(w1.dtype)  # (W, W+1): unit u in segment s
        slopes = w2 @ (w1[:, None] * active)  # (H, W+1)
        intercepts = b2[:, None] + w2 @ (b1[:, None] * active) + (w2 @ torch.where(flat, b1.clamp(min=0), 0.0))[:, None]
        dtype = self.mlp[0].weight.dtype
        return kinks.to(dtype), slopes.to(dtype), intercepts.to(dtype)

    def _needs_grad(self) -> bool:
        """Whether a bias computed now takes gradients to the parameters (then the MLP, as training always did)."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())

    def _folded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """:meth:`fold` without gradients, computed now (W² operations); compiling (Flex's score_mod cannot sort), the
        one :meth:`rotation` computed for this forward pass, None before any."""
        if torch.compiler.is_compiling():
            return self._fold_tables
        with torch.no_grad():
            return self.fold()

    def rotation(self, pos, dtype, centre=None):
        """None (FIRE rotates nothing). The attention context calls it once per forward pass, before it builds
        Flex's score_mod: without gradients to the parameters FIRE folds its MLP here, eager or compiled, for
        :meth:`score_mod` to read inside Flex, where the fold cannot be computed."""
        if not self._needs_grad():
            with torch.no_grad():
                self._fold_tables = self.fold()
        return None

    def score_mod(self, score, h, q_pos, k_pos):
        """score + f_θ(x)[h] from the fold (:meth:`fold`): along the sorted kinks, each one x passes selects the next
        segment's slope and intercept (W compares and selects of head h's entries, no lookup by x), then one
        multiply-add; with gradients to the parameters (or, compiling, no fold kept), :meth:`score_mod_mlp`."""
        folded = None if self._needs_grad() else self._folded()
        if folded is None:
            return self.score_mod_mlp(score, h, q_pos, k_pos)
        kinks, slopes, intercepts = folded  # (W,), (H, W+1), (H, W+1)
        x = self.mlp_input(q_pos, k_pos)  # (1, Tq, Tk) dense; 0-d under Flex
        a, b = slopes[h, 0], intercepts[h, 0]  # (H, 1, 1): segment 0
        for u in range(kinks.shape[0]):  # (unrolled: Flex's score_mod is pointwise) segment #{kinks < x} at the end
            passed = x > kinks[u]
            a, b = torch.where(passed, slopes[h, u + 1], a), torch.where(passed, intercepts[h, u + 1], b)
        return score + a * x + b

    def score_mod_mlp(self, score, h, q_pos, k_pos):
        """score + f_θ(x)[h] with the MLP's hidden layer unrolled (a sum of ``mlp_width`` pointwise terms), same
        signature as :meth:`score_mod`."""
        x = self.mlp_input(q_pos, k_pos)  # (1, Tq, Tk) dense; 0-d under Flex
        w1, b1 = self.mlp[0].weight[:, 0], self.mlp[0].bias  # (W,), (W,)
        w2, b2 = self.mlp[2].weight, self.mlp[2].bias  # (H, W), (H,)
        out = b2[h]  # (H, 1, 1)
        for u in range(w1.shape[0]):  # f_θ(x)[h] = b2[h] + Σ_u W2[h, u]·relu(W1[u]·x + b1[u])
            out = out + w2[h, u] * torch.relu(w1[u] * x + b1[u])  # (H, Tq, Tk)
        return score + out

    def pair_bias(self, q_pos, k_pos, dtype=torch.float32):
        """f_θ(x) for every (query, key) pair, (H, Tq, Tk), future keys included. With gradients to the parameters (or
        compiling): the MLP as matmuls (:meth:`mlp_bias`). Without: the fold (:meth:`fold`), the same bias up to float
        rounding — for consecutive positions on both sides :meth:`sheared_bias`, else each pair's segment looked up
        (:meth:`looked_up_bias`)."""
        if self._needs_grad() or torch.compiler.is_compiling():
            return self.mlp_bias(q_pos, k_pos)
        folded = self._folded()
        if _consecutive(q_pos) and _consecutive(k_pos):
            return self.sheared_bias(q_pos, k_pos, folded)
        return self.looked_up_bias(q_pos, k_pos, folded)

    def mlp_bias(self, q_pos, k_pos):
        """f_θ(x) for every (query, key) pair as matmuls, (H, Tq, Tk): the same bias as :meth:`score_mod_mlp`'s
        unrolled sum up to float rounding (another order of the sum), in far fewer operations; rows in chunks whose
        hidden layer (rows, Tk, W) stays within :data:`HIDDEN_ELEMENTS` floats when no gradient is taken."""
        x = self.mlp_input(q_pos[:, None], k_pos[None, :])  # (Tq, Tk)
        rows = x.shape[0] if torch.is_grad_enabled() else max(1, self.HIDDEN_ELEMENTS // (x.shape[1] * self.config.mlp_width))
        out = [self.mlp(chunk[..., None]).permute(2, 0, 1) for chunk in x.split(rows)]  # (H, rows, Tk) each
        return torch.cat(out, dim=1)  # (H, Tq, Tk)

    def looked_up_bias(self, q_pos, k_pos, folded):
        """The fold's bias of any positions (Tq,), (Tk,) → (H, Tq, Tk): each pair's segment found among the kinks
        (``searchsorted``: #{kinks < x}, as :meth:`score_mod` counts), its slope and intercept looked up; rows in
        chunks of at most :data:`HIDDEN_ELEMENTS` (rows · Tk · H) outputs."""
        kinks, slopes, intercepts = folded  # (W,), (H, W+1), (H, W+1)
        rows = max(1, self.HIDDEN_ELEMENTS // (k_pos.numel() * self.n_head))
        out = []
        for q in q_pos.split(rows):
            x = self.mlp_input(q[:, None], k_pos[None, :])  # (rows, Tk)
            seg = torch.searchsorted(kinks, x)  # (rows, Tk)
            out.append(slopes[:, seg] * x + intercepts[:, seg])  # (H, rows, Tk)
        return torch.cat(out, dim=1)  # (H, Tq, Tk)

    def sheared_bias(self, q_pos, k_pos, folded):
        """The fold's bias of consecutive query and key positions (Tq,), (Tk,) → (H, Tq, Tk), using that
        x = ψ(i − j)/ψ(max(L_thr, i)) is a per-distance vector over a per-query one. Per block of
        :data:`FOLD_ROWS` queries, an array (H, rows, Tk + rows − 1) whose column holds one distance for every row
        (a sheared layout: the (query, key) block is a strided view of it): the normaliser grows with the query, so
        x falls down each column, and a column whose first and last rows lie in the same segment takes that
        segment's slope and intercept for every row — one multiply-add over the block; the few columns a kink
        crosses within the block have their rows' segments looked up. x from :meth:`psi` and :meth:`normaliser`, as
        :meth:`mlp_input` computes it: bitwise the same."""
        kinks, slopes, intercepts = folded  # (W,), (H, W+1), (H, W+1)
        c, H, Q, K = self.c, self.n_head, q_pos.numel(), k_pos.numel()
        d = (q_pos[-1] - k_pos[0]) - torch.arange(Q + K - 1, device=q_pos.device)  # (Q+K−1,): distance of column n
        rel, norm = self.psi(d), self.normaliser(q_pos)  # (Q+K−1,): ψ(i − j); (Q,): ψ(max(L_thr, i)) + ε
        out = None if Q <= self.FOLD_ROWS else torch.empty(H, Q, K, dtype=c.dtype, device=q_pos.device)
        at = torch.arange(H, device=q_pos.device)[:, None, None] * slopes.shape[1]  # (H, 1, 1): head h's first entry
        for r0 in range(0, Q, self.FOLD_ROWS):
            r1 = min(Q, r0 + self.FOLD_ROWS)
            n = r1 - r0  # rows; column m holds distance pos[r1 − 1] − k_pos[0] − m for each of them
            x = rel[Q - r1: Q - r1 + K + n - 1] / norm[r0:r1, None]  # (n, K+n−1), non-increasing down each column
            first, last = torch.searchsorted(kinks, x[0]), torch.searchsorted(kinks, x[-1])  # (K+n−1,) each
            block = torch.addcmul(intercepts[:, last][:, None, :], slopes[:, last][:, None, :], x)  # (H, n, K+n−1)
            mixed = (first != last).nonzero()[:, 0]  # (m,): columns a kink crosses
            if mixed.numel():
                xm = x.index_select(1, mixed)  # (n, m)
                seg = torch.searchsorted(kinks, xm) + at  # (H, n, m): into the flattened tables
                block.index_copy_(2, mixed, torch.take(slopes, seg) * xm + torch.take(intercepts, seg))
            view = block.as_strided((H, n, K), (block.stride(0), K + n - 2, 1), n - 1)  # key j: column j − r + n − 1
            if out is None:
                return view  # (H, Q, K)
            out[:, r0:r1] = view
        return out  # (H, Q, K)


def _consecutive(pos: torch.Tensor) -> bool:
    """Whether int positions (T,) are p, p + 1, …, p + T − 1 (a host read)."""
    return pos.numel() > 0 and (pos.numel() == 1 or bool((pos[1:] - pos[:-1] == 1).all()))
