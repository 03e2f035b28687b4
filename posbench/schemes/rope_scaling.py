"""RoPE's context-extension methods as a registry of same-signature functions (as Hugging Face transformers'
``ROPE_INIT_FUNCTIONS``), shared by every rotary scheme (posbench/schemes/rotary.py: RoPE, xPos).

A method maps a model trained at length L = ``original_length`` to windows up to about s·L, s = ``factor`` ≥ 1:

    inv_freq, attention_factor = SCALINGS[config.scaling](config, dim, pos)

* ``config``: the rotary scheme's Config (``base``, ``factor``, ``original_length``, ``beta_fast``, ``beta_slow``,
  ``yarn_ramp``, ``low_freq_factor``, ``high_freq_factor``); ``dim``: d, the number of rotated dimensions of a head
  (pairs (i, i + d/2), i < d/2); ``pos``: (T,) int64, the positions of the forward pass (only dynamic NTK reads them).
* ``inv_freq``: (d/2,) float64 on ``pos``'s device, the angle per position of each pair;
  ``attention_factor``: a float that multiplies cos and sin (so q·k by its square), YaRN's √(1/t).

Every method keeps scores a function of m − n. A new method is one function added to :data:`SCALINGS`.
"""

from __future__ import annotations

import math

import torch

YARN_RAMPS = ("reference", "paper")  # scheme.yarn_ramp: where YaRN's ramp is linear (see yarn_gamma)


def frequencies(base: float, dim: int, device=None) -> torch.Tensor:
    """θ_i = base^(−2i/d) for i = 0 … d/2 − 1, RoFormer's eq. (15) (Su et al. 2021): (d/2,) float64."""
    return base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)


def ntk_base(base: float, factor: float, dim: int) -> float:
    """The NTK-aware base for a scaling factor s, base·s^(d/(d−2)) (bloc97, 2023; Peng et al. 2023, YaRN §3.1): the
    lowest frequency is interpolated by exactly s, the highest kept. d = 2 (one pair): the base as it is."""
    return base if dim <= 2 else base * factor ** (dim / (dim - 2))


def none(config, dim: int, pos: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Plain RoPE, Su et al. 2021, eq. (34): θ_i as trained."""
    return frequencies(config.base, dim, pos.device), 1.0


def linear(config, dim: int, pos: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Position Interpolation, Chen et al. 2023, §2.2: f'(x, m) = f(x, m/s), i.e. every θ_i divided by s."""
    return frequencies(config.base, dim, pos.device) / config.factor, 1.0


def ntk(config, dim: int, pos: torch.Tensor) -> tuple[torch.Tensor, float]:
    """NTK-aware scaled RoPE: the frequencies of :func:`ntk_base` (base·s^(d/(d−2)))."""
    return frequencies(ntk_base(config.base, config.factor, dim), dim, pos.device), 1.0


def dynamic_ntk(config, dim: int, pos: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Dynamic NTK (emozilla, 2023; YaRN §3.3): the NTK base of a factor that grows with the window,
    s_T = max(1, s·T/L − (s − 1)), T the largest position plus one (HF transformers'
    ``_compute_dynamic_ntk_parameters``, v4.46: ``base * ((factor * seq_len / L) - (factor - 1)) ** (dim / (dim - 2))``
    with ``seq_len`` at least L). posbench scores a window in one forward pass, so every position of the window uses
    its s_T, its first tokens included; at T ≤ L it is plain RoPE."""
    length = int(pos.max()) + 1 if pos.numel() else 0  # the window's T (a host sync: this method only)
    s = max(1.0, config.factor * length / config.original_length - (config.factor - 1))
    return frequencies(ntk_base(config.base, s, dim), dim, pos.device), 1.0


def yarn(config, dim: int, pos: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN, Peng et al. 2023: "NTK-by-parts" interpolation (§3.2) with an attention temperature (§3.4).

    h(θ_i) = (1 − γ_i)·θ_i/s + γ_i·θ_i, with γ_i from :func:`yarn_gamma` (1: the pair is kept, 0: interpolated like
    PI); the temperature t of softmax(q·k/(t·√d)) has √(1/t) = 0.1·ln(s) + 1, the attention factor returned."""
    theta = frequencies(config.base, dim, pos.device)  # (d/2,)
    gamma = yarn_gamma(config, dim, theta)  # (d/2,)
    return (1 - gamma) * theta / config.factor + gamma * theta, 0.1 * math.log(config.factor) + 1.0


def yarn_gamma(config, dim: int, theta: torch.Tensor) -> torch.Tensor:
    """YaRN's ramp γ_i ∈ [0, 1] over the pairs, between the pairs that turn β = ``beta_fast`` and α = ``beta_slow``
    times over the train length L (r(i) = L·θ_i / 2π rotations), in one of two forms (``config.yarn_ramp``):

    * ``reference`` (the default): linear in the pair index, as the YaRN reference code (``find_correction_range``,
      ``linear_ramp_mask``) and HF's ``_compute_yarn_parameters`` compute it. The pair whose angle turns r times is
      i(r) = d·ln(L/(2π·r)) / (2·ln base); the ramp runs from lo = max(⌊i(β)⌋, 0) (γ = 1) to
      hi = min(⌈i(α)⌉, d − 1) (γ = 0; hi = lo + 0.001 when they meet): γ_i = 1 − clamp((i − lo)/(hi − lo), 0, 1).
    * ``paper``: linear in the rotation count, the paper's §3.2: γ = 0 for r < α, 1 for r > β, (r − α)/(β − α)
      between. Inside the ramp the two give frequencies up to ~50% apart.
    """
    if config.yarn_ramp == "paper":
        r = config.original_length * theta / (2 * math.pi)  # rotations of each pair over L, r = L/λ
        return ((r - config.beta_slow) / (config.beta_fast - config.beta_slow)).clamp(0, 1)

    def pair_of(rotations: float) -> float:  # the (fractional) pair index whose angle turns `rotations` times over L
        return dim * math.log(config.original_length / (2 * math.pi * rotations)) / (2 * math.log(config.base))

    lo, hi = max(math.floor(pair_of(config.beta_fast)), 0), min(math.ceil(pair_of(config.beta_slow)), dim - 1)
    hi = hi + 0.001 if hi == lo else hi
    i = torch.arange(dim // 2, dtype=torch.float64, device=theta.device)
    return 1 - ((i - lo) / (hi - lo)).clamp(0, 1)


def llama3(config, dim: int, pos: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Llama 3.1's scaling (Meta's Llama 3.1 release; HF transformers' ``rope_type: llama3``): by the rotations
    r_i = L·θ_i/2π each pair turns over the train length L, with a = ``low_freq_factor``, b = ``high_freq_factor``,
    a pair is kept (θ_i) when r_i > b, divided by s when r_i < a, and between them blended as
    (1 − γ_i)·θ_i/s + γ_i·θ_i with γ_i = (r_i − a)/(b − a); no attention factor. a = b (Llama 4 Scout) is the step at
    a: kept for r_i ≥ a, divided below."""
    theta = frequencies(config.base, dim, pos.device)  # (d/2,)
    r, a, b = config.original_length * theta / (2 * math.pi), config.low_freq_factor, config.high_freq_factor
    gamma = ((r - a) / (b - a)).clamp(0, 1) if b > a else (r >= a).to(theta.dtype)  # (d/2,)
    return (1 - gamma) * theta / config.factor + gamma * theta, 1.0


SCALINGS = {"none": none, "linear": linear, "ntk": ntk, "dynamic_ntk": dynamic_ntk, "yarn": yarn, "llama3": llama3}
