"""Rotary schemes: RoPE (Su et al. 2021), registered as ``rope`` in ``posbench.positional.SCHEMES``.

A rotary scheme turns each query and key head by angles proportional to its position (the ``rotation`` and
``rotate`` hooks of :class:`posbench.positional.PositionalScheme`), so that an attention score depends on
positions only through their difference. Importing ``posbench`` imports this module, which adds its schemes
to the registry.

    from posbench.positional import build_scheme
    rope = build_scheme("rope", d_model=128, n_head=4, base=10000.0)
"""

from __future__ import annotations

import dataclasses

import torch

from posbench.positional import SCHEMES, PositionalScheme, check_base


class RoPE(PositionalScheme):
    """Rotary position embedding, Su et al. 2021 ("RoFormer"), eq. (34).

    Dimension pair i of each query and key head is rotated by angle p·θ_i, θ_i = base^(−2i/Dh), so the
    score q_m·k_n depends on positions only through m − n. Pairs are (i, i + Dh/2) ("rotate half", as in
    GPT-NeoX), a fixed permutation of the paper's adjacent pairs that leaves every score unchanged.
    """

    @dataclasses.dataclass
    class Config(PositionalScheme.Config):
        """base: θ of the frequencies θ_i = base^(−2i/Dh) (RoFormer uses 10000); must be > 0."""

        base: float = 10000.0

        def resolve(self, seq_len: int, longest: int) -> None:
            check_base(self.base)

    def __init__(self, d_model, n_head, config=None):
        super().__init__(d_model, n_head, config)
        head_dim = d_model // n_head
        inv_freq = self.config.base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (Dh/2,)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotation(self, pos, dtype):
        """pos: (T,) → (cos, sin), each (T, Dh) in ``dtype``: angles p·θ_i computed in float64, the sine's
        first half negated so that :meth:`rotate` needs no negation."""
        angles = pos.to(torch.float64)[:, None] * self.inv_freq  # (T, Dh/2)
        sin = angles.sin()
        return torch.cat((angles, angles), dim=-1).cos().to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)  # 2 × (T, Dh)

    def rotate(self, q, k, rotation):
        cos, sin = (t.to(q.dtype) for t in rotation)  # (T, Dh); a no-op cast unless autocast changed q's dtype

        def turn(x):  # x: (B, H, T, Dh) → x·cos + (x2, x1)·(−sin, sin), i.e. pair (x1, x2) turned by the angle
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat((x2, x1), dim=-1) * sin

        return turn(q), turn(k)


SCHEMES.update(rope=RoPE)
