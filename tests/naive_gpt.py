"""A float64 reference of posbench's GPT, written from the recipe (docs/design.md §2) with loops over layers and
explicit (H, T, T) score matrices, independently of posbench/model.py and posbench/attention.py: the tests of
per-layer schemes and of length-dependent attention scaling compare the model against it.

    logits = naive_logits(model, idx, bias=lambda layer, pos: ..., factor=lambda layer, n: ...)

Only the model's weights are read (``model.tok``, ``model.blocks[l]``'s LayerNorms, qkv, proj, MLP, ``model.ln_f``);
everything positional is given by the caller.
"""

from __future__ import annotations

import math

import torch


def layer_norm(x: torch.Tensor, ln: torch.nn.LayerNorm) -> torch.Tensor:
    """x: (T, D) float64 → (x − mean) / sqrt(var + eps) · γ + β."""
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mu) / torch.sqrt(var + ln.eps) * ln.weight.double() + ln.bias.double()


def rope_by_hand(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x: (H, T, Dh) float64, pair (i, i + Dh/2) turned by pos·inv_freq[i] (RoFormer eq. 34, rotate-half pairs)."""
    half = x.shape[-1] // 2
    out = x.clone()
    for i in range(half):
        angle = pos.double() * inv_freq[i]  # (T,)
        a, b = x[..., i], x[..., i + half]
        out[..., i], out[..., i + half] = a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()
    return out


def naive_logits(model, idx: torch.Tensor, bias=None, factor=None, inv_freq=None) -> torch.Tensor:
    """idx: (T,) int64, one window → (T, V) float64 logits of ``model``'s weights.

    bias(layer, pos) → (H, T, T) float64 additive bias of query a and key b (any value above the diagonal), or None;
    factor(layer, n) → (H, T) float64 multiplier of the content logits q·k/√Dh of query a (n = a + 1 keys), or None;
    inv_freq: (Dh/2,) float64 rotary frequencies applied to q and k (RoPE), or None."""
    T = idx.shape[0]
    pos = torch.arange(T)
    D = model.tok.weight.shape[1]
    H = model.n_head
    Dh = D // H
    x = model.tok.weight.double()[idx] * model.embed_scale  # (T, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    n = torch.arange(1, T + 1, dtype=torch.float64)
    for layer, block in enumerate(model.blocks):
        h = layer_norm(x, block.ln1)
        q, k, v = (h @ block.attn.qkv.weight.double().T).split(D, dim=-1)  # 3 × (T, D)
        q, k, v = (t.view(T, H, Dh).transpose(0, 1) for t in (q, k, v))  # (H, T, Dh)
        if inv_freq is not None:
            q, k = rope_by_hand(q, pos, inv_freq), rope_by_hand(k, pos, inv_freq)
        scores = q @ k.transpose(1, 2) / math.sqrt(Dh)  # (H, T, T)
        if factor is not None:
            scores = scores * factor(layer, n)[:, :, None]
        if bias is not None:
            scores = scores + bias(layer, pos)
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # (H, T, T)
        y = (attn @ v).transpose(0, 1).reshape(T, D)  # (T, D)
        x = x + y @ block.attn.proj.weight.double().T
        h = layer_norm(x, block.ln2)
        fc, out = block.mlp[0], block.mlp[2]
        h = torch.nn.functional.gelu(h @ fc.weight.double().T + fc.bias.double())
        x = x + h @ out.weight.double().T + out.bias.double()
    return layer_norm(x, model.ln_f) @ model.tok.weight.double().T  # (T, V)
