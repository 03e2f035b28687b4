"""A decoder-only GPT (pre-LayerNorm, GELU MLP, tied embeddings) that knows no positional scheme by name.

One recipe for every scheme (docs/design.md §2), so that a comparison differs in positions only: token
embeddings are multiplied by sqrt(D) before the scheme adds any positions (fairseq's ``embed_scale``, the
code of the ALiBi paper; Vaswani et al. 2017, §3.4), weights start as in GPT-2, and the head is tied.

The positional scheme is a module handed in at construction; the model calls its three hooks
(``embed``, ``rotate``, ``bias``; see posbench/positional.py) and nothing else. Attention runs through
``torch.nn.functional.scaled_dot_product_attention``: with ``is_causal=True`` when the scheme has no
bias, otherwise with the scheme's bias plus the causal mask, built one block of queries at a time so
that no (B, H, T, T) tensor is ever materialised at long evaluation lengths.

    scheme = build_scheme("alibi", d_model=128, n_head=4)
    model = GPT(vocab_size=4096, n_layer=4, n_head=4, d_model=128, d_ff=512, scheme=scheme)
    logits = model(idx)  # idx: (B, T) int64 → (B, T, V)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from posbench.positional import PositionalScheme

BIAS_ELEMENTS = 1 << 24  # largest bias block (H · queries · keys floats) built at once: 64 MiB in fp32


class Attention(nn.Module):
    """Causal multi-head self-attention whose positions come from the shared scheme."""

    def __init__(self, d_model: int, n_head: int, dropout: float, scheme: PositionalScheme):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.scheme = [scheme]  # a list, so the shared scheme is registered once, in GPT

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        scheme = self.scheme[0]
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, D // self.n_head).permute(2, 0, 3, 1, 4)  # 3 × (B, H, T, Dh)
        q, k = scheme.rotate(q, k, pos)
        dropout = self.dropout if self.training else 0.0
        if scheme.bias(pos[:1], pos[:1]) is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)  # (B, H, T, Dh)
        else:
            y = torch.empty_like(q)
            block = max(1, BIAS_ELEMENTS // (self.n_head * T))
            for s in range(0, T, block):
                e = min(T, s + block)  # queries s..e-1 see keys 0..e-1
                bias = scheme.bias(pos[s:e], pos[:e])  # (H, e-s, e)
                causal = pos[None, :e] > pos[s:e, None]  # (e-s, e)
                mask = bias.masked_fill(causal, float("-inf")).to(q.dtype)
                y[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e], attn_mask=mask, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))  # (B, T, D)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model, n_head, d_ff, dropout, scheme):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head, dropout, scheme)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model), nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pos):
        x = x + self.drop(self.attn(self.ln1(x), pos))
        return x + self.mlp(self.ln2(x))  # (B, T, D)


class GPT(nn.Module):
    """Decoder-only causal language model with a pluggable positional scheme.

    Args:
        vocab_size: V, tokens in the vocabulary.
        n_layer, n_head, d_model, d_ff: depth, heads H, width D, MLP hidden width.
        dropout: dropout probability on residual branches (0 disables it).
        scheme: the positional scheme, shared by all layers.
        scale_embeddings: multiply token embeddings by sqrt(D) (True, the recipe for every scheme; False is
            GPT-2's and nanoGPT's choice, kept so that models trained that way can be rebuilt).
    Raises:
        ValueError: ``n_head`` does not divide ``d_model``.

    Initialisation follows GPT-2 (Radford et al. 2019): N(0, 0.02), residual projections scaled
    by 1/sqrt(2·n_layer), biases zero. The scheme's own parameters keep the initialisation it gave them.
    """

    def __init__(self, vocab_size: int, n_layer: int, n_head: int, d_model: int, d_ff: int,
                 scheme: PositionalScheme, dropout: float = 0.0, scale_embeddings: bool = True):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"n_head={n_head} does not divide d_model={d_model}")
        self.scheme = scheme
        self.embed_scale = math.sqrt(d_model) if scale_embeddings else 1.0
        self.tok = nn.Embedding(vocab_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, d_ff, dropout, scheme) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied input and output embeddings
        for name, p in self.named_parameters():
            if name.startswith("scheme."):
                continue
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """idx: (B, T) int64 token ids; pos: (T,) absolute positions, default 0…T−1 → logits (B, T, V)."""
        if pos is None:
            pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.scheme.embed(self.tok(idx) * self.embed_scale, pos))  # (B, T, D)
        for block in self.blocks:
            x = block(x, pos)
        return self.head(self.ln_f(x))  # (B, T, V)
