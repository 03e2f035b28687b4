"""Rotary schemes: RoPE (Su et al. 2021), with the context-extension methods that rescale its angles at evaluation
(``scheme.scaling``), and xPos (Sun et al. 2022), registered as ``rope`` and ``xpos`` in
``posbench.positional.SCHEMES``.

A rotary scheme turns each query and key head by angles proportional to its position (the ``rotation`` and
``rotate`` hooks of :class:`posbench.positional.PositionalScheme`), so that an attention score depends on
positions only through their difference. Importing ``posbench`` imports this module, which adds its schemes
to the registry.

    from posbench.positional import build_scheme
    rope = build_scheme("rope", d_model=128, n_head=4, base=10000.0)
    yarn = build_scheme("rope", d_model=128, n_head=4, scaling="yarn", factor=16.0, original_length=128)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from posbench.positional import SCHEMES, PositionalScheme, check_base, is_number

SCALINGS = ("none", "linear", "ntk", "dynamic_ntk", "yarn")


class RoPE(PositionalScheme):
    """Rotary position embedding, Su et al. 2021 ("RoFormer"), eq. (34), with optional context extension.

    Dimension pair i of each query and key head is rotated by angle p·θ_i, θ_i = base^(−2i/Dh), so the
    score q_m·k_n depends on positions only through m − n. Pairs are (i, i + Dh/2) ("rotate half", as in
    GPT-NeoX), a fixed permutation of the paper's adjacent pairs that leaves every score unchanged.

    ``scaling`` rescales the angles of a model trained at length L = ``original_length`` by the factor
    s = ``factor`` (s ≥ 1), to serve windows up to about s·L; every method keeps scores a function of m − n:

    * ``none`` — the angles above (the default; bit-identical to RoPE before scaling existed).
    * ``linear`` — Position Interpolation, Chen et al. 2023 ("Extending Context Window of Large Language
      Models via Positional Interpolation"), §2.2: f'(x, m) = f(x, m·L/L') = f(x, m/s), every position divided by s.
    * ``ntk`` — NTK-aware scaled RoPE (bloc97, 2023; stated in Peng et al. 2023, YaRN §3.1): the base
      becomes base' = base · s^(Dh/(Dh−2)), so the lowest frequency is interpolated by exactly s while the
      highest is (nearly) unchanged.
    * ``dynamic_ntk`` — Dynamic NTK (emozilla, 2023; YaRN §3.3): the NTK base of a factor that grows with
      the length T the model is looking at, s_T = max(1, s·T/L − (s − 1)), i.e. base' = base · s_T^(Dh/(Dh−2)),
      as in Hugging Face transformers' ``modeling_rope_utils._compute_dynamic_ntk_parameters`` (v4.46,
      ``base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))`` with
      ``seq_len`` at least L). T is the largest position of the forward pass plus one (HF's
      ``max(position_ids) + 1``), i.e. the window length for positions 0…T−1. posbench scores a whole window
      in one forward pass, so every position of a window uses that window's s_T, including its first tokens
      (token-by-token generation would give position p the factor of p + 1); at T ≤ L it is plain RoPE.
    * ``yarn`` — YaRN, Peng et al. 2023 ("YaRN: Efficient Context Window Extension of Large Language
      Models"): "NTK-by-parts" interpolation (§3.2) plus an attention temperature (§3.4). For dimension
      pair d the wavelength is λ_d = 2π/θ_d and r(d) = L/λ_d counts its rotations over the train length;
      the ramp γ(r) = 0 for r < α, 1 for r > β, (r − α)/(β − α) between, with α = ``beta_slow`` and
      β = ``beta_fast`` (the paper's α = 1, β = 32 for LLaMA); the frequency is
      h(θ_d) = (1 − γ(r(d)))·θ_d/s + γ(r(d))·θ_d: pairs that turn fewer than α times in L are interpolated
      like PI, pairs that turn more than β times are left alone. The temperature t of softmax(q·k/(t·√Dh))
      has √(1/t) = 0.1·ln(s) + 1; both cos and sin are multiplied by it, so q·k is scaled by 1/t. The ramp
      here is the paper's, linear in r; the reference code (the YaRN repository, HF's
      ``_compute_yarn_parameters``) instead ramps linearly in the pair index between the rounded pair
      indices where r = β and r = α, which differs only inside the ramp.
    """

    @dataclasses.dataclass
    class Config(PositionalScheme.Config):
        """base: θ of the frequencies θ_i = base^(−2i/Dh) (RoFormer uses 10000); must be > 0.
        scaling: none | linear | ntk | dynamic_ntk | yarn, a context-extension method (see :class:`RoPE`).
        factor: the scaling factor s >= 1 (1 with scaling=none).
        beta_fast, beta_slow: YaRN's ramp ends β and α in rotations over the train length, 0 < α < β.
        original_length: the train length L the methods scale from; None resolves to train.seq_len
            when a method is chosen (and stays None with scaling=none)."""

        base: float = 10000.0
        scaling: str = "none"
        factor: float = 1.0
        beta_fast: float = 32.0
        beta_slow: float = 1.0
        original_length: Optional[int] = None

        def resolve(self, seq_len: int, longest: int) -> None:
            check_base(self.base)
            if self.scaling not in SCALINGS:
                raise ValueError(f"scaling={self.scaling!r}: choose one of {', '.join(SCALINGS)}")
            if not is_number(self.factor) or self.factor < 1:
                raise ValueError(f"factor={self.factor!r}: the scaling factor must be a number >= 1")
            if self.scaling == "none" and self.factor != 1:
                raise ValueError(f"factor={self.factor!r}: scaling=none uses no factor; choose a scaling method "
                                 f"({', '.join(SCALINGS[1:])}) or factor=1")
            if not is_number(self.beta_slow) or not is_number(self.beta_fast) or not 0 < self.beta_slow < self.beta_fast:
                raise ValueError(f"beta_slow={self.beta_slow!r}: YaRN's ramp needs 0 < beta_slow < beta_fast "
                                 f"(beta_fast={self.beta_fast!r})")
            if self.original_length is None and self.scaling != "none":
                self.original_length = seq_len
            n = self.original_length
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"original_length={n!r}: the train length must be a positive integer")

        def label(self) -> str:
            return "" if self.scaling == "none" else f"+{self.scaling}×{self.factor:g}"  # rope+yarn×16

    def __init__(self, d_model, n_head, config=None):
        super().__init__(d_model, n_head, config)
        c = self.config
        if c.scaling not in SCALINGS:
            raise ValueError(f"unknown RoPE scaling {c.scaling!r}; choose one of {', '.join(SCALINGS)}")
        if c.scaling != "none" and not c.original_length:
            raise ValueError(f"RoPE scaling={c.scaling!r} needs original_length, the train length")
        head_dim = d_model // n_head
        self.head_dim = head_dim
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim  # 2i/Dh, (Dh/2,)
        inv_freq = c.base ** (-exponent)  # θ_i = base^(−2i/Dh)
        self.mscale = 1.0  # √(1/t): YaRN multiplies cos and sin by it
        if c.scaling == "ntk":
            inv_freq = self.ntk_base(c.factor) ** (-exponent)
        elif c.scaling == "yarn":
            r = c.original_length * inv_freq / (2 * math.pi)  # r(d) = L / λ_d, λ_d = 2π/θ_d
            gamma = ((r - c.beta_slow) / (c.beta_fast - c.beta_slow)).clamp(0, 1)  # the ramp γ(r)
            inv_freq = (1 - gamma) * inv_freq / c.factor + gamma * inv_freq  # h(θ_d)
            self.mscale = 0.1 * math.log(c.factor) + 1.0
        self.register_buffer("exponent", exponent, persistent=False)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def ntk_base(self, factor: float) -> float:
        """base' = base · factor^(Dh/(Dh−2)), the NTK-aware base for a scaling factor (Dh = 2: the base)."""
        if self.head_dim <= 2:
            return self.config.base
        return self.config.base * factor ** (self.head_dim / (self.head_dim - 2))

    def dynamic_factor(self, length: int) -> float:
        """Dynamic NTK's factor for a forward pass over ``length`` positions: max(1, s·T/L − (s − 1))."""
        s, n = self.config.factor, self.config.original_length
        return max(1.0, s * length / n - (s - 1))

    def rotation(self, pos, dtype):
        """pos: (T,) → (cos, sin), each (T, Dh) in ``dtype``: angles p·θ_i computed in float64 (as the scaling
        method changes them), the sine's first half negated so that :meth:`rotate` needs no negation."""
        p, inv_freq, scaling = pos.to(torch.float64), self.inv_freq, self.config.scaling
        if scaling == "linear":
            p = p / self.config.factor
        elif scaling == "dynamic_ntk":
            length = int(pos.max()) + 1 if pos.numel() else 0
            inv_freq = self.ntk_base(self.dynamic_factor(length)) ** (-self.exponent)
        angles = p[:, None] * inv_freq  # (T, Dh/2)
        sin = angles.sin()
        cos, sin = torch.cat((angles, angles), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)  # 2 × (T, Dh)
        if self.mscale != 1.0:
            cos, sin = cos * self.mscale, sin * self.mscale
        return cos.to(dtype), sin.to(dtype)

    def rotate(self, q, k, rotation):
        cos, sin = (t.to(q.dtype) for t in rotation)  # (T, Dh); a no-op cast unless autocast changed q's dtype

        def turn(x):  # x: (B, H, T, Dh) → x·cos + (x2, x1)·(−sin, sin), i.e. pair (x1, x2) turned by the angle
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat((x2, x1), dim=-1) * sin

        return turn(q), turn(k)


class XPos(PositionalScheme):
    """xPos, Sun et al. 2022 ("A Length-Extrapolatable Transformer"), §3.2: RoPE with an exponential decay.

    Dimension pair i is turned as in :class:`RoPE` (angle p·θ_i, θ_i = base^(−2i/Dh), pairs (i, i + Dh/2)), and
    scaled by ζ_i^(p/B) in a query and ζ_i^(−p/B) in a key, with ζ_i = (i/(Dh/2) + γ)/(1 + γ) ∈ (0, 1) and
    B = ``scale_base``; the score of query n and key m then carries ζ_i^((n − m)/B) per pair, a decay with the
    distance that is strongest for the fastest-turning pairs. Only n − m matters, so positions are centred:
    p is replaced by p − c, c the middle of the forward pass's positions ((min + max)/2, as torchscale centres
    its window), which changes no score and keeps the scales within ζ_0^(±T/(2B)): at T = 16384 and B = 512,
    within 0.29^(±16), finite in float32 and bfloat16. (The paper's blockwise causal attention at inference is
    not part of it: posbench scores each window as one block.)
    """

    @dataclasses.dataclass
    class Config(PositionalScheme.Config):
        """base: θ of the frequencies θ_i = base^(−2i/Dh) (10000), > 0. gamma: γ of ζ_i = (2i/Dh + γ)/(1 + γ),
        > 0 (the paper's 0.4). scale_base: B, the distance over which a score decays by ζ_i, > 0 (512)."""

        base: float = 10000.0
        gamma: float = 0.4
        scale_base: float = 512.0

        def resolve(self, seq_len: int, longest: int) -> None:
            check_base(self.base)
            if not is_number(self.gamma) or not self.gamma > 0:
                raise ValueError(f"gamma={self.gamma!r}: xPos's gamma must be a number > 0 (the paper uses 0.4)")
            if not is_number(self.scale_base) or not self.scale_base > 0:
                raise ValueError(f"scale_base={self.scale_base!r}: xPos's scale base must be a number > 0 (512)")

    def __init__(self, d_model, n_head, config=None):
        super().__init__(d_model, n_head, config)
        c = self.config
        if not c.gamma > 0 or not c.scale_base > 0:
            raise ValueError(f"xPos needs gamma > 0 and scale_base > 0, got {c.gamma} and {c.scale_base}")
        head_dim = d_model // n_head
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim  # 2i/Dh = i/(Dh/2), (Dh/2,)
        self.register_buffer("inv_freq", c.base ** (-exponent), persistent=False)
        self.register_buffer("zeta", (exponent + c.gamma) / (1 + c.gamma), persistent=False)

    def rotation(self, pos, dtype):
        """pos: (T,) → (cos_q, sin_q, cos_k, sin_k), each (T, Dh) in ``dtype``: RoPE's tables (computed in float64)
        times ζ_i^((p − c)/B) for queries and ζ_i^(−(p − c)/B) for keys, c the middle of ``pos``."""
        p = pos.to(torch.float64)
        angles = p[:, None] * self.inv_freq  # (T, Dh/2)
        centre = (p.min() + p.max()) / 2 if p.numel() else 0.0
        scale = self.zeta ** ((p - centre)[:, None] / self.config.scale_base)  # (T, Dh/2)
        sin = angles.sin()
        cos, sin, scale = (torch.cat(t, dim=-1) for t in ((angles.cos(), angles.cos()), (-sin, sin), (scale, scale)))
        return tuple(t.to(dtype) for t in (cos * scale, sin * scale, cos / scale, sin / scale))

    def rotate(self, q, k, rotation):
        cos_q, sin_q, cos_k, sin_k = (t.to(q.dtype) for t in rotation)  # (T, Dh)

        def turn(x, cos, sin):  # as RoPE's, with the scale folded into the tables
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat((x2, x1), dim=-1) * sin

        return turn(q, cos_q, sin_q), turn(k, cos_k, sin_k)


SCHEMES.update(rope=RoPE, xpos=XPos)
