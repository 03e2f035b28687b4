"""The decoder's layers: causal self-attention (grouped-query where it has fewer key/value heads than query heads) and
the two blocks a model is built from (posbench/model/gpt.py's ``GPT`` stacks them):

* ``gpt`` (:class:`Block`) — GPT-2's: pre-LayerNorm, a GELU MLP with biases; posbench's block since its first run;
* ``llama`` (:class:`LlamaBlock`) — Llama's (Touvron et al. 2023, §2.2; Llama 2 and 3, Mistral, Qwen 2 and 3,
  SmolLM 2 and 3): pre-RMSNorm (Zhang & Sennrich 2019), a SwiGLU MLP (Shazeer 2020, eq. 6) without biases.

    attn = Attention(d_model=128, n_head=4, n_kv_head=2)   # grouped-query: 2 key/value heads, each serving 2 queries
    block = LlamaBlock(d_model=128, n_head=4, d_ff=344, n_kv_head=2)
    y = block(x, ctx)   # x: (B, T, D), ctx: posbench.attention.dispatch.context(...) → (B, T, D)
"""

from __future__ import annotations

import torch
from torch import nn

from posbench.attention import dispatch

SSMAX_INIT = 0.43  # s of SSMax at initialisation: the default of the unofficial scalable-softmax package (PyPI)
QK_NORM_EPS = 1e-6  # QK-norm's RMSNorm epsilon (Gemma 3's, Qwen 3's; Llama 4 uses 1e-5)


class Attention(nn.Module):
    """Causal self-attention whose positions come from the context of the forward pass
    (posbench/attention/dispatch.py: this layer's scheme, kernel, window, rotation tables, bias; dropout included), with the
    length-dependent scaling of the queries (``attn_scale``: posbench/attention/temperature.py), optionally QK-norm
    (``qk_norm``: RMSNorm of each head's query and key before any rotation, epsilon ``qk_eps``, with or without a
    learned gain per head dimension, ``qk_weight``) and a learned sink logit per head (``sink``).

    ``n_head`` query heads of width ``head_dim`` (None: d_model / n_head) and ``n_kv_head`` key/value heads (None:
    n_head), each key/value head shared by n_head / n_kv_head consecutive query heads (grouped-query attention,
    Ainslie et al. 2023, §2.2); one projection makes queries, keys and values (``qkv``: (H + 2·H_kv)·Dh outputs, with
    biases where ``qkv_bias``, as Qwen 2's), one maps the heads back (``proj``, no bias). With n_kv_head = n_head and
    no bias it is posbench's attention as before, parameter for parameter.

    Raises:
        ValueError: n_kv_head does not divide n_head, or head_dim is None and n_head does not divide d_model.
    """

    def __init__(self, d_model: int, n_head: int, attn_scale: str = "none", qk_norm: bool = False,
                 qk_weight: bool = True, sink: bool = False, n_kv_head: int | None = None, head_dim: int | None = None,
                 qkv_bias: bool = False, qk_eps: float = QK_NORM_EPS):
        super().__init__()
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        if n_kv_head < 1 or n_head % n_kv_head:
            raise ValueError(f"n_kv_head={n_kv_head} must divide n_head={n_head} (each key/value head serves as many "
                             "query heads)")
        if head_dim is None and d_model % n_head:
            raise ValueError(f"n_head={n_head} does not divide d_model={d_model}: give head_dim")
        self.n_head, self.n_kv_head = n_head, n_kv_head
        self.head_dim = d_model // n_head if head_dim is None else head_dim
        self.qkv = nn.Linear(d_model, (n_head + 2 * n_kv_head) * self.head_dim, bias=qkv_bias)
        self.proj = nn.Linear(n_head * self.head_dim, d_model, bias=False)
        if attn_scale == "ssmax":  # Nakanishi 2025: s learned per head (and per layer)
            self.ssmax = nn.Parameter(torch.full((n_head,), SSMAX_INIT))  # (H,)
        self.q_norm = self.k_norm = None
        if qk_norm:  # (Dh,) gains, initialised to 1, where qk_weight
            self.q_norm, self.k_norm = (nn.RMSNorm(self.head_dim, eps=qk_eps, elementwise_affine=qk_weight)
                                        for _ in range(2))
        self.sink = nn.Parameter(torch.zeros(n_head)) if sink else None  # (H,) (drawn by GPT's initialisation)

    def forward(self, x: torch.Tensor, ctx: dispatch.Context, factor: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, D); factor: None (no scaling), or the (T, 1) factor on each query (``temperature.factor``: for
        ``ssmax`` ln n, which the layer multiplies by its learned s_h) → (B, T, D)."""
        B, T, _ = x.shape
        H, K, Dh = self.n_head, self.n_kv_head, self.head_dim
        if K == H:
            q, k, v = self.qkv(x).view(B, T, 3, H, Dh).permute(2, 0, 3, 1, 4)  # 3 × (B, H, T, Dh)
        else:
            q, k, v = self.qkv(x).split([H * Dh, K * Dh, K * Dh], dim=-1)
            q = q.view(B, T, H, Dh).transpose(1, 2)  # (B, H, T, Dh)
            k, v = (t.view(B, T, K, Dh).transpose(1, 2) for t in (k, v))  # (B, K, T, Dh)
        if self.q_norm is not None:  # x / rms(x) per head, before the rotation (which keeps each head's norm)
            q, k = self.q_norm(q), self.k_norm(k)
        if ctx.remap is None:  # (a remap turns q and k per region, in its kernel)
            q, k = ctx.scheme.rotate(q, k, ctx.rotation)
        if factor is not None:  # logits × factor, applied to the queries so that every kernel runs unchanged
            if hasattr(self, "ssmax"):
                factor = self.ssmax[:, None, None] * factor.to(self.ssmax.dtype)  # (H, T, 1)
            q = q * factor.to(q.dtype)  # factor: (H, T, 1) or (T, 1)
        if K != H:  # each key/value head to the query heads it serves: every kernel then sees H heads
            k, v = (t.repeat_interleave(H // K, dim=1) for t in (k, v))  # (B, H, T, Dh)
        y = dispatch.attend(q, k, v, ctx) if self.sink is None else dispatch.attend(q, k, v, ctx, self.sink)
        return self.proj(y.transpose(1, 2).reshape(B, T, H * Dh))  # (B, T, D)


class Block(nn.Module):
    """GPT-2's pre-LayerNorm block: x + attn(ln(x)), then x + mlp(ln(x)), the MLP Linear(D, F), GELU, Linear(F, D)
    with biases (Radford et al. 2019, §2.3). ``attention``: :class:`Attention`'s keyword options."""

    def __init__(self, d_model, n_head, d_ff, dropout=0.0, norm_eps=1e-5, **attention):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model, eps=norm_eps), nn.LayerNorm(d_model, eps=norm_eps)
        self.attn = Attention(d_model, n_head, **attention)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model), nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, ctx, factor=None):
        x = x + self.drop(self.attn(self.ln1(x), ctx, factor))
        return x + self.mlp(self.ln2(x))  # (B, T, D)


class SwiGLU(nn.Module):
    """down(SiLU(gate(x)) ⊙ up(x)), three bias-free Linear maps D → F → D (Shazeer 2020, "GLU Variants Improve
    Transformer", eq. 6; Llama's MLP)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0):
        super().__init__()
        self.gate, self.up = nn.Linear(d_model, d_ff, bias=False), nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(nn.functional.silu(self.gate(x)) * self.up(x)))  # (B, T, D)


class LlamaBlock(Block):
    """Llama's pre-RMSNorm block: x + attn(rms(x)), then x + swiglu(rms(x)), RMSNorm with a gain and ``norm_eps``
    (Zhang & Sennrich 2019), the MLP :class:`SwiGLU`, no biases but ``qkv_bias``'s (Touvron et al. 2023, §2.2)."""

    def __init__(self, d_model, n_head, d_ff, dropout=0.0, norm_eps=1e-5, **attention):
        nn.Module.__init__(self)
        self.ln1, self.ln2 = nn.RMSNorm(d_model, eps=norm_eps), nn.RMSNorm(d_model, eps=norm_eps)
        self.attn = Attention(d_model, n_head, **attention)
        self.mlp = SwiGLU(d_model, d_ff, dropout)
        self.drop = nn.Dropout(dropout)


def final_norm(block: str, d_model: int, eps: float) -> nn.Module:
    """The norm after the last block: LayerNorm for ``gpt``, RMSNorm for ``llama``."""
    return nn.LayerNorm(d_model, eps=eps) if block == "gpt" else nn.RMSNorm(d_model, eps=eps)
