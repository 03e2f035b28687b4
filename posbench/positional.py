"""Positional schemes behind one interface, and the registry the model builds them from.

Every scheme plugs into exactly one of three hooks of :class:`PositionalScheme` (docs/design.md §3):

* ``embed(x, pos)``                      additive absolute positions (sinusoidal, learned)
* ``rotation(pos, dtype)`` and
  ``rotate(q, k, rotation)``             rotary positions applied to queries and keys (RoPE): the tables are
                                         computed once per forward pass, then applied in every layer
* ``score_mod(score, h, q_pos, k_pos)``  an additive attention bias (ALiBi), with ``has_bias = True``

Positions are explicit absolute token indices, so an evaluator may shift or scale them. The model never
probes a hook to learn what a scheme does: the class attributes ``has_bias`` and ``key_only_bias`` say it,
and posbench/attention.py picks the attention kernel from them.
Every scheme declares its hyperparameters in a nested dataclass ``Config`` (defaults, checks, and derived
defaults filled by ``Config.resolve(seq_len, longest)``); the configuration system builds its schema from it
(``posbench.config.register``), so a scheme, its options and their checks live in one place.
Build a scheme by name: ``build_scheme("rope", d_model=128, n_head=4, base=500.0)``. To add one, subclass
:class:`PositionalScheme` (with a ``Config`` if it has options), override one hook and add the class to
:data:`SCHEMES`; ``scheme=<name> scheme.<option>=<value>`` then works on the command line.

This module holds the interface, the registry, the absolute schemes (sinusoidal, learned) and ALiBi; the
rotary family is in posbench/rotary.py and the relative-bias family in posbench/t5_kerple.py (T5, KERPLE) and
posbench/sandwich_fire.py (Sandwich, FIRE), which add their schemes to :data:`SCHEMES` when ``posbench`` is imported.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn


class PositionalScheme(nn.Module):
    """No positional information (NoPE): the causal mask is the only source of order. Every hook is the
    identity. The base of every scheme.

    All schemes share one constructor signature, ``(d_model, n_head, config=None)``, so the registry can
    build any of them; ``config`` is an instance of the scheme's own ``Config`` (None: its defaults), kept as
    ``self.config``.

    Class attributes (what the attention kernel is chosen from; posbench/attention.py):
        has_bias: ``score_mod`` adds a bias to the attention scores. False: causal attention is all there
            is, and the fastest causal kernel runs.
        key_only_bias: the bias has the form b(h, i, j) = g(h, j) − g(h, i) for every query position i and key
            position j (any bias linear in i − j, such as ALiBi's, has it). Then, for a reference position c,
            b(h, i, j) = b(h, c, j) + (a term that depends on i alone), and softmax ignores a term constant
            across a query's row, so the key-only bias ``score_mod(0, h, c, k_pos)`` gives the same
            attention; the kernel may fold it into one extra head dimension of q and k.

    Args:
        d_model: model width D.
        n_head: attention heads H; the head width is D / H.
        config: the scheme's hyperparameters, a ``self.Config``; None gives the defaults.
    """

    has_bias: bool = False
    key_only_bias: bool = False
    weight_decay: bool = False  # AdamW decays this scheme's parameters (a decision per scheme, not by tensor rank)

    @dataclasses.dataclass
    class Config:
        """The scheme's hyperparameters: none. A scheme with options declares its own ``@dataclass class
        Config(PositionalScheme.Config)`` with typed fields (their types are the configuration's types),
        defaults, a docstring, and a :meth:`resolve` that checks them."""

        def resolve(self, seq_len: int, longest: int) -> None:
            """Fill derived defaults in place from the train length ``seq_len`` (L) and check every value;
            ``longest`` is the longest length the model will see (L or the longest evaluation length).

            Raises ValueError whose message starts with ``<field>=<value>`` and says what is allowed."""

        def label(self) -> str:
            """What the scheme's name alone does not say about this variant, appended to it in every label
            (results, eval file names, wandb, report rows, plots): "" here; RoPE's ``+yarn×16``."""
            return ""

    def __init__(self, d_model: int, n_head: int, config: Config | None = None):
        super().__init__()
        self.d_model, self.n_head = d_model, n_head
        self.config = self.Config() if config is None else config

    @classmethod
    def options(cls) -> list[str]:
        """The names of the scheme's options: the fields of its ``Config``, in order."""
        return [f.name for f in dataclasses.fields(cls.Config)]

    @classmethod
    def make_config(cls, **options) -> Config:
        """``cls.Config(**options)``, not resolved. Raises ValueError for an option the Config lacks, starting
        ``<option>=<value>`` and listing the scheme's options."""
        allowed = cls.options()
        for key, value in options.items():
            if key not in allowed:
                raise ValueError(f"{key}={value!r}: the {cls.__name__} scheme has no option {key!r}; its options: "
                                 f"{', '.join(allowed) or 'none'}")
        return cls.Config(**options)

    def embed(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: (B, T, D) token embeddings, pos: (T,) int64 → (B, T, D)."""
        return x

    def rotation(self, pos: torch.Tensor, dtype: torch.dtype) -> object:
        """pos: (T,) int64 → whatever :meth:`rotate` needs for these positions (RoPE: cos and sin tables),
        computed once per forward pass and shared by every layer; None for a scheme that does not rotate.
        ``dtype`` is the activations' dtype (float32, or float64 in a reference computation)."""
        return None

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rotation: object) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: (B, H, T, Dh), rotation: what :meth:`rotation` returned for their positions → rotated
        (q, k) of the same shapes."""
        return q, k

    def score_mod(self, score: torch.Tensor, h: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """The attention score of query position ``q_pos`` and key position ``k_pos`` in head ``h``, given the
        score q·k/√Dh before positions: score + bias(h, q_pos, k_pos). Identity here.

        One pointwise description serves every kernel: FlexAttention calls it with 0-d tensors (int32 indices,
        the score in the kernel's dtype); the dense kernel with broadcastable tensors, e.g. score a 0-d zero,
        h (H, 1, 1), q_pos (1, Tq, 1) and k_pos (1, 1, Tk) int64, to build a bias block (H, Tq, Tk). It must
        therefore be additive in ``score`` (the dense kernel evaluates it at score 0 and adds the result) and use
        only broadcasting tensor operations. The causal mask is the attention's, so the bias need not mask.
        A scheme that overrides it sets ``has_bias = True``. Learned parameters used here get gradients.
        """
        return score


class Sinusoidal(PositionalScheme):
    """Fixed sinusoidal absolute positions, Vaswani et al. 2017 ("Attention Is All You Need"), §3.5.

    PE(p, 2i) = sin(p / base^(2i/D)),  PE(p, 2i+1) = cos(p / base^(2i/D)), added to the token
    embeddings (which the model has already scaled by sqrt(D) for every scheme, docs/design.md §2).
    Defined for every position p ≥ 0. Requires an even D (ValueError otherwise).
    """

    @dataclasses.dataclass
    class Config(PositionalScheme.Config):
        """base: the wavelength base (Vaswani et al. use 10000); must be > 0."""

        base: float = 10000.0

        def resolve(self, seq_len: int, longest: int) -> None:
            check_base(self.base)

    def __init__(self, d_model, n_head, config=None):
        super().__init__(d_model, n_head, config)
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


LEARNED_ROWS_PER_L = 16  # default learned table: 16·L rows, enough for the default evaluation lengths L…16L


class Learned(PositionalScheme):
    """A trained table of absolute position embeddings (GPT-2 style), ``max_positions`` rows of width D.

    Rows past the train length L never receive a gradient; evaluating past ``max_positions`` is a
    configuration error found before training (``Config.resolve``, called by ``posbench.config.finalize``).
    Raises ValueError when ``max_positions`` is missing (unresolved) or not positive. The table is
    weight-decayed, as GPT-2's and nanoGPT's position embeddings are.
    """

    weight_decay = True

    @dataclasses.dataclass
    class Config(PositionalScheme.Config):
        """max_positions: rows of the table; None resolves to 16 × L (never sized from the evaluation lengths,
        so the model does not depend on how it is evaluated); must be >= the longest length it serves."""

        max_positions: Optional[int] = None

        def resolve(self, seq_len: int, longest: int) -> None:
            if self.max_positions is None:
                self.max_positions = LEARNED_ROWS_PER_L * seq_len
            n = self.max_positions
            if isinstance(n, bool) or not isinstance(n, int) or n < longest:
                raise ValueError(f"max_positions={n}: a learned table of {n} rows cannot serve length {longest}; "
                                 f"use lengths <= {n} or train with a larger max_positions")

    def __init__(self, d_model, n_head, config=None):
        super().__init__(d_model, n_head, config)
        n = self.config.max_positions
        if not n or n < 1:
            raise ValueError(f"the learned scheme needs max_positions >= 1, got {n}")
        self.table = nn.Embedding(n, d_model)
        nn.init.normal_(self.table.weight, std=0.02)

    def embed(self, x, pos):
        return x + self.table(pos).to(x.dtype)  # (B, T, D)


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

    No position embeddings at all; slopes m_h from :func:`alibi_slopes`. The bias is linear in i − j, so it
    is key-only up to a per-query constant (``key_only_bias``): −m_h·(i − j) = −m_h·(c − j) − m_h·(i − c).
    """

    has_bias = True
    key_only_bias = True

    def __init__(self, d_model, n_head, config=None):
        super().__init__(d_model, n_head, config)
        self.register_buffer("slopes", torch.tensor(alibi_slopes(n_head)), persistent=False)  # (H,)

    def score_mod(self, score, h, q_pos, k_pos):
        return score - self.slopes[h] * (q_pos - k_pos)  # slope (float32) × integer distance: exact for 2^-k slopes


SCHEMES: dict[str, type[PositionalScheme]] = {
    "nope": PositionalScheme,
    "sinusoidal": Sinusoidal,
    "learned": Learned,
    "alibi": ALiBi,
}


def check_base(base) -> None:
    """Raise ValueError (``base=<value>: ...``) unless ``base``, a wavelength base, is a number > 0."""
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
        raise ValueError(f"base={base!r}: the wavelength base must be a number > 0")


def is_int(value) -> bool:
    """``value`` is an int and not a bool (a check of a scheme's option)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """``value`` is a finite int or float and not a bool (a check of a scheme's option)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def build_scheme(name: str, d_model: int, n_head: int, **options) -> PositionalScheme:
    """The scheme registered as ``name``, built with its ``make_config(**options)`` (not resolved: give
    resolved values, e.g. the learned scheme's ``max_positions``).

    Raises:
        ValueError: ``name`` is not in :data:`SCHEMES` (the message lists the choices), an option the scheme
            lacks (the message names it and the scheme's options), or a value the scheme's constructor refuses.
    """
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; choose one of: {', '.join(sorted(SCHEMES))}")
    cls = SCHEMES[name]
    return cls(d_model, n_head, cls.make_config(**options))


def variant_label(scheme: dict) -> str:
    """The label of a scheme section ``{"name": ..., **options}`` (a recorded config's): the name and its
    Config's :meth:`~PositionalScheme.Config.label`, e.g. ``t5``, ``rope``, ``rope+yarn×16``. A name not in
    :data:`SCHEMES`, or options it does not take, label as the name alone."""
    name = scheme.get("name", "")
    try:
        return name + SCHEMES[name].make_config(**{k: v for k, v in scheme.items() if k != "name"}).label()
    except (KeyError, ValueError, TypeError):
        return name
