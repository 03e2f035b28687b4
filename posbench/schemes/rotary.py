"""Rotary schemes: RoPE (Su et al. 2021) with GPT-NeoX's partial rotary, p-RoPE (Barbero et al. 2025) and xPos (Sun
et al. 2022); registered as ``rope``, ``p_rope`` and ``xpos``. Every rotary scheme takes every context-extension method
of posbench/schemes/rope_scaling.py (``scheme.scaling``), at training or at evaluation.

A rotary scheme turns dimension pairs of each query and key head by angles proportional to its position (the
``rotation`` and ``rotate`` hooks), so that an attention score depends on positions only through their difference:
:func:`rotary_tables` makes the cos and sin tables once per forward pass, :func:`apply_rotary` turns q and k with them.

    from posbench.schemes import build_scheme
    rope = build_scheme("rope", d_model=128, n_head=4, base=10000.0)
    yarn = build_scheme("rope", d_model=128, n_head=4, scaling="yarn", factor=16.0, original_length=128)
    neox = build_scheme("rope", d_model=128, n_head=4, rotary_fraction=0.25)
    p_rope = build_scheme("p_rope", d_model=128, n_head=4, p=0.75)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from posbench.schemes.base import PositionalScheme, check_base, is_int, is_number, register
from posbench.schemes.rope_scaling import SCALINGS, YARN_RAMPS


def rotary_tables(angles: torch.Tensor, factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """angles: (T, P) float64, the angle of pair i at each position → (cos, sin), each (T, 2P) float64, laid out for
    :func:`apply_rotary`: pair i in columns i and i + P ("rotate half", GPT-NeoX's layout), the sine's first half
    negated, both multiplied by the attention ``factor`` (YaRN's √(1/t); 1: untouched)."""
    sin = angles.sin()
    cos, sin = torch.cat((angles, angles), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)  # 2 × (T, 2P)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, Dh); cos, sin: (T, d), d ≤ Dh, from :func:`rotary_tables` (xPos folds its scale into them) → x
    with pair (x_i, x_{i+d/2}) of its first d dimensions turned, (x_i·cos − x_{i+d/2}·sin, x_{i+d/2}·cos + x_i·sin),
    and its other Dh − d dimensions as they are (partial rotary)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # a no-op cast unless autocast changed x's dtype
    d = cos.shape[-1]
    if d < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :d], cos, sin), x[..., d:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin  # (B, H, T, Dh)


@dataclasses.dataclass
class RotaryConfig(PositionalScheme.Config):
    """The options of every rotary scheme: the frequencies' base, and the context-extension method.

    base: θ of the frequencies θ_i = base^(−2i/d) (RoFormer uses 10000); must be > 0.
    scaling: none | linear | ntk | dynamic_ntk | yarn | llama3, a context-extension method
        (posbench/schemes/rope_scaling.py).
    factor: the scaling factor s >= 1 (1 with scaling=none).
    beta_fast, beta_slow: YaRN's ramp ends β and α in rotations over the train length, 0 < α < β (32 and 1).
    original_length: the train length L the methods scale from; None fills to train.seq_len when a method is chosen
        (and stays None with scaling=none).
    yarn_ramp: reference (the YaRN code's and HF's ramp, linear in the pair index) or paper (the paper's §3.2 ramp,
        linear in the rotation count).
    low_freq_factor, high_freq_factor: Llama 3.1's blend ends a <= b in rotations over the train length (1 and 4;
        Llama 4 Scout: 1 and 1); read by scaling=llama3 only (kept, unused, under another scaling, as YaRN's options
        are: a re-evaluation of a llama3 run with another scaling carries them)."""

    base: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_length: Optional[int] = None
    yarn_ramp: str = "reference"
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def fill(self, seq_len: int) -> None:
        if self.original_length is None and self.scaling != "none":
            self.original_length = seq_len

    def check(self, longest: int | None = None) -> None:
        check_base(self.base)
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling={self.scaling!r}: choose one of {', '.join(SCALINGS)}")
        if not is_number(self.factor) or self.factor < 1:
            raise ValueError(f"factor={self.factor!r}: the scaling factor must be a number >= 1")
        if self.scaling == "none" and self.factor != 1:
            raise ValueError(f"factor={self.factor!r}: scaling=none uses no factor; choose a scaling method "
                             f"({', '.join(list(SCALINGS)[1:])}) or factor=1")
        if not is_number(self.beta_slow) or not is_number(self.beta_fast) or not 0 < self.beta_slow < self.beta_fast:
            raise ValueError(f"beta_slow={self.beta_slow!r}: YaRN's ramp needs 0 < beta_slow < beta_fast "
                             f"(beta_fast={self.beta_fast!r})")
        n = self.original_length
        if n is not None and (not is_int(n) or n < 1):
            raise ValueError(f"original_length={n!r}: the train length must be a positive integer")
        if self.yarn_ramp not in YARN_RAMPS:
            raise ValueError(f"yarn_ramp={self.yarn_ramp!r}: choose one of {', '.join(YARN_RAMPS)}")
        a, b = self.low_freq_factor, self.high_freq_factor
        if not is_number(a) or not is_number(b) or not 0 < a <= b:
            raise ValueError(f"low_freq_factor={a!r}: Llama 3's blend needs 0 < low_freq_factor <= high_freq_factor "
                             f"(high_freq_factor={b!r})")

    def label(self) -> str:
        if self.scaling == "none":
            return ""
        ramp = "_paper" if self.scaling == "yarn" and self.yarn_ramp == "paper" else ""
        if self.scaling == "llama3" and (self.low_freq_factor, self.high_freq_factor) != (1.0, 4.0):
            ramp = f"[{self.low_freq_factor:g}-{self.high_freq_factor:g}]"  # rope+llama3[1-1]×16
        return f"+{self.scaling}{ramp}×{self.factor:g}"  # rope+yarn×16, rope+yarn_paper×16, rope+llama3×8


class _Rotary(PositionalScheme):
    """What every rotary scheme shares: the frequencies of its Config's scaling method for a forward pass.
    Raises ValueError when a method is chosen but ``original_length`` was never filled with the train length."""

    Config = RotaryConfig
    rotary = True
    fine_tune_options = ("base", "scaling", "factor", "beta_fast", "beta_slow", "original_length", "yarn_ramp",
                         "low_freq_factor", "high_freq_factor")  # the context-extension methods: a new base
    # (Xiong et al. 2023's ABF), PI, NTK, YaRN, Llama 3's

    def __init__(self, d_model, n_head, config=None, head_dim=None):
        super().__init__(d_model, n_head, config, head_dim)
        c = self.config
        if c.scaling != "none" and c.original_length is None:
            raise ValueError(f"scaling={c.scaling!r} needs original_length, the train length it scales from "
                             "(Config.resolve fills it with train.seq_len)")

    def frequencies(self, pos: torch.Tensor, dim: int) -> tuple[torch.Tensor, float]:
        """The scaling method's (inverse frequencies (dim/2,) float64, attention factor) for positions ``pos``."""
        return SCALINGS[self.config.scaling](self.config, dim, pos)


@register("rope")
class RoPE(_Rotary):
    """Rotary position embedding, Su et al. 2021 ("RoFormer"), eq. (34), with GPT-NeoX's partial rotary and the
    context-extension methods of posbench/schemes/rope_scaling.py.

    Dimension pair i of the rotated part of each query and key head is turned by angle p·θ_i, θ_i = base^(−2i/d),
    so the score q_m·k_n depends on positions only through m − n. Pairs are (i, i + d/2) ("rotate half", as in
    GPT-NeoX), a fixed permutation of the paper's adjacent pairs that leaves every score unchanged. Partial rotary
    (Black et al. 2022, "GPT-NeoX-20B", §2; HF's ``rotary_pct``): only the first d = 2·max(1, ⌊⌊f·Dh⌋/2⌋) of the Dh
    dimensions turn, f = ``rotary_fraction``, with the frequencies of a d-wide RoPE; the rest carry no position.
    f = 1 (the default) is RoPE bit for bit. ``scaling`` rescales the frequencies (see :class:`RotaryConfig`).
    """

    @dataclasses.dataclass
    class Config(RotaryConfig):
        """The options of :class:`RotaryConfig`, and rotary_fraction: f in (0, 1], the fraction of each head's
        dimensions that turn (GPT-NeoX-20B: 0.25); 1 turns all of them."""

        rotary_fraction: float = 1.0

        def check(self, longest: int | None = None) -> None:
            super().check(longest)
            if not is_number(self.rotary_fraction) or not 0 < self.rotary_fraction <= 1:
                raise ValueError(f"rotary_fraction={self.rotary_fraction!r}: the rotated fraction of a head must be "
                                 "in (0, 1]")

        def label(self) -> str:
            partial = "" if self.rotary_fraction == 1 else f"+partial{self.rotary_fraction:g}"
            return partial + super().label()  # rope+partial0.25+yarn×4

    def __init__(self, d_model, n_head, config=None, head_dim=None):
        super().__init__(d_model, n_head, config, head_dim)
        self.rotated = 2 * max(1, int(self.head_dim * self.config.rotary_fraction) // 2)  # d: even, 2 … Dh

    @property
    def inv_freq(self) -> torch.Tensor:
        """(d/2,) float64: the frequencies θ_i = base^(−2i/d) the model trained with (before any scaling)."""
        return SCALINGS["none"](self.config, self.rotated, torch.empty(0))[0]

    def rotation(self, pos, dtype, centre=None):
        """pos: (T,) → (cos, sin), each (T, d) in ``dtype``: angles p·θ_i of the scaling method in float64 (no centre:
        a turn depends on the position alone)."""
        inv_freq, factor = self.frequencies(pos, self.rotated)  # (d/2,)
        cos, sin = rotary_tables(pos.to(torch.float64)[:, None] * inv_freq, factor)  # 2 × (T, d)
        return cos.to(dtype), sin.to(dtype)

    def rotate(self, q, k, rotation, key_rotation=None):
        (cos, sin), (key_cos, key_sin) = rotation, key_rotation or rotation
        return apply_rotary(q, cos, sin), apply_rotary(k, key_cos, key_sin)


@register("p_rope")
class PRoPE(RoPE):
    """p-RoPE, Barbero et al. 2025 ("Round and round we go! What makes Rotary Positional Encodings useful?", ICLR 2025,
    arXiv:2410.06205): RoPE that keeps only the highest-frequency fraction p of its frequency pairs and leaves the
    others unrotated (frequency 0, an infinite wavelength), so they carry no position; 0-RoPE is NoPE, 1-RoPE is RoPE.

    Pair i (i < Dh/2; pairs (i, i + Dh/2) as in :class:`RoPE`) of each query and key head at position m turns by
    angle m·g_i, with RoPE's frequencies θ_i = base^(−2i/Dh) (RoFormer eq. 15):

        g_i = θ_i   for i < k,     g_i = 0   for k ≤ i < Dh/2,     k = ⌊p·Dh/2⌋,

    so the score of query m and key n is Σ_{i<k} RoPE's term of pair i at distance m − n plus Σ_{i≥k} (q_i·k_i +
    q_{i+Dh/2}·k_{i+Dh/2}), a plain dot product. k is a floor, as Hugging Face's ``proportional`` RoPE (Gemma 4's,
    ``_compute_proportional_rope_parameters``: ``int(p * head_dim // 2)`` pairs) counts it; a floor never keeps more
    than the fraction asked for, and ``rotary_fraction`` rounds that way too. (A slack of 1e-9 is added before
    flooring, so that a decimal p whose p·Dh/2 is whole is not one pair short from binary rounding.) A p below 2/Dh
    keeps no pair. p = 1 is RoPE bit for bit (the same tables); p = 0, or any p that keeps no pair, is NoPE: without
    an attention factor (every scaling but YaRN) the rotation is skipped, so the logits are NoPE's bit for bit.

    Scalings (``scheme.scaling``, at training or at evaluation): the kept pairs turn at exactly the scaled frequencies
    of the full-width RoPE (the method computed for d = Dh), the dropped pairs at 0. YaRN's attention factor √(1/t)
    multiplies every dimension's cos and sin, the unrotated ones included (cos 0 = 1, sin 0 = 0), so its temperature
    scales the whole score q·k, as YaRN §3.4 defines it; at p = 0 YaRN is NoPE with that temperature.

    Not GPT-NeoX's partial rotary (:class:`RoPE`'s ``rotary_fraction`` f): that turns the first ⌊f·Dh⌋ *dimensions*
    with the frequencies of a narrower RoPE (base^(−2i/d), again spanning 1 down to about 1/base); p-RoPE keeps the
    full head's frequencies and removes the slowest ones (the slowest kept is base^(−2(k−1)/Dh), ≈ base^(−p)).
    Cost: RoPE's (full-width tables, RoPE's rotation); RoPE's own path is untouched.
    """

    @dataclasses.dataclass
    class Config(RotaryConfig):
        """The options of :class:`RotaryConfig`, and p: the fraction in [0, 1] of each head's Dh/2 frequency pairs that
        turn, the highest-frequency ones (⌊p·Dh/2⌋ pairs); 1 is RoPE, 0 NoPE; the paper's best is 0.75."""

        p: float = 0.75

        def check(self, longest: int | None = None) -> None:
            super().check(longest)
            if not is_number(self.p) or not 0 <= self.p <= 1:
                raise ValueError(f"p={self.p!r}: p-RoPE's fraction of frequency pairs kept must be a number in [0, 1] "
                                 "(1: RoPE, 0: NoPE; the paper's best: 0.75)")

        def label(self) -> str:
            return f"+p{self.p:g}" + super().label()  # p_rope+p0.75, p_rope+p0.75+yarn×4

    def __init__(self, d_model, n_head, config=None, head_dim=None):
        _Rotary.__init__(self, d_model, n_head, config, head_dim)  # not RoPE's: p-RoPE has no rotary_fraction
        self.rotated = 2 * max(1, self.head_dim // 2)  # every pair is in the tables (the dropped ones at angle 0): Dh
        self.kept = min(self.rotated // 2, math.floor(self.config.p * self.rotated / 2 + 1e-9))  # k = ⌊p·Dh/2⌋

    def drop(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """inv_freq: (Dh/2,) float64, the frequencies of the full head → the same with the last Dh/2 − k (the lowest)
        set to 0; the tensor itself when every pair is kept (p = 1)."""
        if self.kept == inv_freq.numel():
            return inv_freq
        return torch.cat((inv_freq[: self.kept], inv_freq.new_zeros(inv_freq.numel() - self.kept)))  # (Dh/2,)

    @property
    def inv_freq(self) -> torch.Tensor:
        """(Dh/2,) float64: the frequencies the model trained with (before any scaling), θ_i for the k kept pairs and 0
        for the others."""
        return self.drop(super().inv_freq)

    def frequencies(self, pos: torch.Tensor, dim: int) -> tuple[torch.Tensor, float]:
        """The scaling method's (inverse frequencies (dim/2,) float64 of a dim-wide RoPE, the lowest dim/2 − k set to 0,
        attention factor) for positions ``pos``."""
        inv_freq, factor = super().frequencies(pos, dim)  # (Dh/2,)
        return self.drop(inv_freq), factor

    def rotation(self, pos, dtype, centre=None):
        """pos: (T,) → RoPE's (cos, sin), each (T, Dh) in ``dtype``, with angle 0 on the dropped pairs; None (no
        rotation: NoPE exactly) when no pair is kept and the scaling method's attention factor is 1."""
        if self.kept == 0 and self.frequencies(pos, self.rotated)[1] == 1.0:
            return None
        return super().rotation(pos, dtype)

    def rotate(self, q, k, rotation, key_rotation=None):
        return (q, k) if rotation is None else super().rotate(q, k, rotation, key_rotation)


@register("xpos")
class XPos(_Rotary):
    """xPos, Sun et al. 2022 ("A Length-Extrapolatable Transformer"), §3.2: RoPE with an exponential decay.

    Dimension pair i is turned as in :class:`RoPE` (angle p·θ_i, pairs (i, i + Dh/2), the frequencies of the
    scaling method), and scaled by ζ_i^(p/B) in a query and ζ_i^(−p/B) in a key, with ζ_i = (i/(Dh/2) + γ)/(1 + γ)
    ∈ (0, 1) and B = ``scale_base``; the score of query n and key m then carries ζ_i^((n − m)/B) per pair, a decay
    with the distance that is strongest for the fastest-turning pairs. Only n − m matters, so positions are
    centred: p is replaced by p − c, c the middle of the forward pass's positions ((min + max)/2, as torchscale
    centres its window), which changes no score and keeps the scales within ζ_0^(±T/(2B)): at T = 16384 and
    B = 512, within 0.29^(±16), finite in float32 and bfloat16. (The paper's blockwise causal attention at
    inference is not part of it: posbench scores each window as one block.)
    """

    @dataclasses.dataclass
    class Config(RotaryConfig):
        """The options of :class:`RotaryConfig`, and gamma: γ of ζ_i = (2i/Dh + γ)/(1 + γ), > 0 (the paper's 0.4);
        scale_base: B, the distance over which a score decays by ζ_i, > 0 (512)."""

        gamma: float = 0.4
        scale_base: float = 512.0

        def check(self, longest: int | None = None) -> None:
            super().check(longest)
            if not is_number(self.gamma) or not self.gamma > 0:
                raise ValueError(f"gamma={self.gamma!r}: xPos's gamma must be a number > 0 (the paper uses 0.4)")
            if not is_number(self.scale_base) or not self.scale_base > 0:
                raise ValueError(f"scale_base={self.scale_base!r}: xPos's scale base must be a number > 0 (512)")

    def __init__(self, d_model, n_head, config=None, head_dim=None):
        super().__init__(d_model, n_head, config, head_dim)
        c, exponent = self.config, torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim  # 2i/Dh
        self.register_buffer("zeta", (exponent + c.gamma) / (1 + c.gamma), persistent=False)  # (Dh/2,)

    def rotation(self, pos, dtype, centre=None):
        """pos: (T,) → (cos_q, sin_q, cos_k, sin_k), each (T, Dh) in ``dtype``: RoPE's tables (in float64) times
        ζ_i^((p − c)/B) for queries and ζ_i^(−(p − c)/B) for keys, c = ``centre``, None: the middle of ``pos``."""
        p = pos.to(torch.float64)
        inv_freq, factor = self.frequencies(pos, self.head_dim)  # (Dh/2,)
        cos, sin = rotary_tables(p[:, None] * inv_freq, factor)  # 2 × (T, Dh)
        if centre is None:
            centre = (p.min() + p.max()) / 2 if p.numel() else 0.0
        scale = self.zeta ** ((p - centre)[:, None] / self.config.scale_base)  # (T, Dh/2)
        scale = torch.cat((scale, scale), dim=-1)  # (T, Dh)
        return tuple(t.to(dtype) for t in (cos * scale, sin * scale, cos / scale, sin / scale))

    def rotate(self, q, k, rotation, key_rotation=None):
        cos_q, sin_q, _, _ = rotation
        _, _, cos_k, sin_k = key_rotation or rotation
        return apply_rotary(q, cos_q, sin_q), apply_rotary(k, cos_k, sin_k)
