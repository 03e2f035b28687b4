"""Absolute positions added to the token embeddings: fixed sinusoids (``sinusoidal``) and a trained table (``learned``).

Both use the ``embed(x, pos)`` hook; the model has already scaled the token embeddings by √D for every scheme
(docs/design.md §2), so the positions are added to embeddings of comparable size.

    from posbench.schemes import build_scheme
    sinusoidal = build_scheme("sinusoidal", d_model=128, n_head=4)
    learned = build_scheme("learned", d_model=128, n_head=4, max_positions=2048)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from posbench.schemes.base import PositionalScheme, check_base, is_int, register

LEARNED_ROWS_PER_L = 16  # default learned table: 16·L rows, enough for the default evaluation lengths L…16L


@register("sinusoidal")
class Sinusoidal(PositionalScheme):
    """Fixed sinusoidal absolute positions, Vaswani et al. 2017 ("Attention Is All You Need"), §3.5.

    PE(p, 2i) = sin(p / base^(2i/D)),  PE(p, 2i+1) = cos(p / base^(2i/D)), added to the token embeddings.
    Defined for every position p ≥ 0. Requires an even D (ValueError otherwise).
    """

    @dataclasses.dataclass
    class Config(PositionalScheme.Config):
        """base: the wavelength base (Vaswani et al. use 10000); must be > 0."""

        base: float = 10000.0

        def check(self, longest: int | None = None) -> None:
            check_base(self.base)

    def __init__(self, d_model, n_head, config=None, head_dim=None):
        super().__init__(d_model, n_head, config, head_dim)
        if d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {d_model}")
        inv_freq = self.config.base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (D/2,)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def table(self, pos: torch.Tensor) -> torch.Tensor:
        """pos: (T,) → PE: (T, D), float32, sin in even columns and cos in odd columns."""
        angles = pos.to(torch.float64)[:, None] * self.inv_freq  # (T, D/2)
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1).float()  # (T, D)

    def embed(self, x, pos):
        return x + self.table(pos).to(x.dtype)  # (B, T, D)


@register("learned")
class Learned(PositionalScheme):
    """A trained table of absolute position embeddings (GPT-2 style), ``max_positions`` rows of width D.

    Rows past the train length L never receive a gradient; evaluating past ``max_positions`` is a configuration
    error found before training (``Config.resolve``, called where the run's config is made). The table is
    weight-decayed, as GPT-2's and nanoGPT's position embeddings are. Raises ValueError when built with a config
    whose ``max_positions`` is still None (resolve it with the train length first).
    """

    weight_decay = True
    fine_tune_options = ("max_positions",)  # the table may grow (adopt)

    @dataclasses.dataclass
    class Config(PositionalScheme.Config):
        """max_positions: rows of the table; None fills to 16 × L (never sized from the evaluation lengths, so the
        model does not depend on how it is evaluated); must be >= the longest length it serves."""

        max_positions: Optional[int] = None

        def fill(self, seq_len: int) -> None:
            if self.max_positions is None:
                self.max_positions = LEARNED_ROWS_PER_L * seq_len

        def check(self, longest: int | None = None) -> None:
            n = self.max_positions
            if n is None:
                return
            if not is_int(n) or n < max(1, longest or 1):
                raise ValueError(f"max_positions={n}: a learned table of {n} rows cannot serve length {longest or 1}; "
                                 f"use lengths <= {n} or train with a larger max_positions")

    def __init__(self, d_model, n_head, config=None, head_dim=None):
        super().__init__(d_model, n_head, config, head_dim)
        n = self.config.max_positions
        if n is None:
            raise ValueError("the learned scheme needs max_positions, its number of rows (Config.resolve fills it "
                             "with 16 × the train length)")
        self.table = nn.Embedding(n, d_model)
        nn.init.normal_(self.table.weight, std=0.02)

    def adopt(self, trained, rows, trained_length, new_length):
        """Take a parent's table (N rows) into this one (N' rows, as initialised). ``rows=scheme``: the parent's N
        rows are kept bit for bit, rows N…N'−1 stay as this scheme initialised them (N' < N: ValueError, a table
        does not shrink). ``rows=interpolate``: Position Interpolation (Chen et al. 2023, eq. 2) on the table: row
        p < L' (the new train length) becomes the parent's table at x = p·L/L' (L: the parent's train length, the
        rows it trained), linear between rows ⌊x⌋ and ⌈x⌉ (the last trained row, L − 1, where ⌈x⌉ reaches L);
        rows L'…N'−1 stay as initialised."""
        old, new = trained["table.weight"], self.table.weight  # (N, D), (N', D)
        if old.shape[0] > new.shape[0]:
            raise ValueError(f"max_positions={new.shape[0]}: the parent's table has {old.shape[0]} rows, and a "
                             f"fine-tune keeps or grows it (max_positions >= {old.shape[0]})")
        with torch.no_grad():
            if rows == "scheme":
                new[: old.shape[0]].copy_(old)
            else:  # interpolate (config.INIT_ROWS: nothing else reaches here)
                rows = torch.arange(min(new_length, new.shape[0]), dtype=torch.float64, device=old.device)  # (L',)
                x = rows * trained_length / new_length  # (L',)
                low = x.floor().long().clamp(max=trained_length - 1)
                high = (low + 1).clamp(max=trained_length - 1)
                w = (x - low).to(old.dtype)[:, None]  # (L', 1)
                new[: len(x)].copy_(old[low] * (1 - w) + old[high] * w)

    def embed(self, x, pos):
        return x + self.table(pos).to(x.dtype)  # (B, T, D)
