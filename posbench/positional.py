"""Positional schemes behind one interface, and the registry the model builds them from.

Every scheme plugs into exactly one of three hooks of :class:`PositionalScheme` (docs/design.md §3):

* ``embed(x, pos)``       additive absolute positions (sinusoidal, learned)
* ``rotate(q, k, pos)``   rotary positions applied to queries and keys (RoPE)
* ``bias(q_pos, k_pos)``  an additive attention bias (ALiBi)

Positions are explicit absolute token indices, so an evaluator may shift or scale them.
Build a scheme by name: ``build_scheme("alibi", d_model=128, n_head=4)``. To add one, subclass
:class:`PositionalScheme`, override one hook and add the class to :data:`SCHEMES`.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class PositionalScheme(nn.Module):
    """No positional information (NoPE): every hook is the identity. The base of every scheme.

    All schemes share one constructor signature so the registry can build any of them.

    Args:
        d_model: model width D.
        n_head: attention heads H; the head width is D / H.
        base: wavelength base of sinusoidal / rotary frequencies (10000 in both papers).
        max_positions: rows of a learned position table (unused by other schemes).
    """

    def __init__(self, d_model: int, n_head: int, base: float = 10000.0, max_positions: int | None = None):
        super().__init__()
        self.d_model, self.n_head = d_model, n_head

    def embed(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: (B, T, D) token embeddings, pos: (T,) int64 → (B, T, D)."""
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: (B, H, T, Dh), pos: (T,) → rotated (q, k) of the same shapes."""
        return q, k

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """q_pos: (Tq,), k_pos: (Tk,) → additive attention bias (H, Tq, Tk), or None for no bias.

        The model applies the causal mask itself; the bias need not be masked.
        """
        return None


class Sinusoidal(PositionalScheme):
    """Fixed sinusoidal absolute positions, Vaswani et al. 2017 ("Attention Is All You Need"), §3.5.

    PE(p, 2i) = sin(p / base^(2i/D)),  PE(p, 2i+1) = cos(p / base^(2i/D)), added to the token
    embeddings (which the model has already scaled by sqrt(D) for every scheme, docs/design.md §2).
    Defined for every position p ≥ 0. Requires an even D (ValueError otherwise).
    """

    def __init__(self, d_model, n_head, base=10000.0, max_positions=None):
        super().__init__(d_model, n_head)
        if d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {d_model}")
        inv_freq = base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (D/2,)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def table(self, pos: torch.Tensor) -> torch.Tensor:
        """pos: (T,) → PE: (T, D), float32, sin in even columns and cos in odd columns."""
        angles = pos.to(torch.float64)[:, None] * self.inv_freq  # (T, D/2)
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1).float()  # (T, D)

    def embed(self, x, pos):
        return x + self.table(pos).to(x.dtype)  # (B, T, D)


class Learned(PositionalScheme):
    """A trained table of absolute position embeddings (GPT-2 style), ``max_positions`` rows of width D.

    Rows past the train length L never receive a gradient; evaluating past ``max_positions`` is a
    configuration error found before training (``posbench.config.finalize``). Raises ValueError
    when ``max_positions`` is missing or not positive.
    """

    def __init__(self, d_model, n_head, base=10000.0, max_positions=None):
        super().__init__(d_model, n_head)
        if not max_positions or max_positions < 1:
            raise ValueError(f"the learned scheme needs max_positions >= 1, got {max_positions}")
        self.table = nn.Embedding(max_positions, d_model)
        nn.init.normal_(self.table.weight, std=0.02)

    def embed(self, x, pos):
        return x + self.table(pos).to(x.dtype)  # (B, T, D)


class RoPE(PositionalScheme):
    """Rotary position embedding, Su et al. 2021 ("RoFormer"), eq. (34).

    Dimension pair i of each query and key head is rotated by angle p·θ_i, θ_i = base^(−2i/Dh), so the
    score q_m·k_n depends on positions only through m − n. Pairs are (i, i + Dh/2) ("rotate half", as in
    GPT-NeoX), a fixed permutation of the paper's adjacent pairs that leaves every score unchanged.
    """

    def __init__(self, d_model, n_head, base=10000.0, max_positions=None):
        super().__init__(d_model, n_head)
        head_dim = d_model // n_head
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (Dh/2,)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotate(self, q, k, pos):
        angles = pos.to(torch.float64)[:, None] * self.inv_freq  # (T, Dh/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, Dh)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)

        def turn(x):  # x: (B, H, T, Dh)
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin

        return turn(q), turn(k)


def alibi_slopes(n_head: int) -> list[float]:
    """ALiBi head slopes, Press et al. 2022 ("Train Short, Test Long"), §3 and the paper's ``get_slopes``.

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


class ALiBi(PositionalScheme):
    """Attention with Linear Biases, Press et al. 2022, §3: score(i, j) += −m_h · (i − j) for keys j ≤ i.

    No position embeddings at all; slopes m_h from :func:`alibi_slopes`.
    """

    def __init__(self, d_model, n_head, base=10000.0, max_positions=None):
        super().__init__(d_model, n_head)
        self.register_buffer("slopes", torch.tensor(alibi_slopes(n_head)), persistent=False)  # (H,)

    def bias(self, q_pos, k_pos):
        distance = (q_pos[:, None] - k_pos[None, :]).to(self.slopes.dtype)  # (Tq, Tk)
        return -self.slopes[:, None, None] * distance  # (H, Tq, Tk)


SCHEMES: dict[str, type[PositionalScheme]] = {
    "nope": PositionalScheme,
    "sinusoidal": Sinusoidal,
    "learned": Learned,
    "rope": RoPE,
    "alibi": ALiBi,
}


def build_scheme(name: str, d_model: int, n_head: int, **options) -> PositionalScheme:
    """The scheme registered as ``name``; ``options`` are ``base`` and ``max_positions``.

    Raises:
        ValueError: ``name`` is not in :data:`SCHEMES` (the message lists the choices).
    """
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; choose one of: {', '.join(sorted(SCHEMES))}")
    return SCHEMES[name](d_model, n_head, **options)
