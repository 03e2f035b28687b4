"""A float64 reference of posbench's GPT, written from the recipe (docs/design.md §2) with loops over layers and
explicit (H, T, T) score matrices, independently of posbench/model/gpt.py and posbench/attention/dispatch.py: the tests of
per-layer schemes and of length-dependent attention scaling compare the model against it.

    logits = naive_logits(model, idx, bias=lambda layer, pos: ..., factor=lambda layer, n: ...)

Only the model's weights are read (``model.tok``, ``model.blocks[l]``'s LayerNorms, qkv, proj, MLP, ``model.ln_f``);
everything positional is given by the caller, and so are a hybrid model's per-layer parts (optional hooks: which keys
each query sees, a sink logit per head, QK-norm's gains, a rotation per layer).
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


def rms_norm(x: torch.Tensor, gain: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x: (..., Dh) float64 → x / sqrt(mean(x²) + eps) · gain (no gain: 1), over the last dimension."""
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if gain is None else y * gain


def naive_logits(model, idx: torch.Tensor, bias=None, factor=None, inv_freq=None, visible=None, sink=None,
                 qk_norm=None) -> torch.Tensor:
    """idx: (T,) int64, one window → (T, V) float64 logits of ``model``'s weights.

    bias(layer, pos) → (H, T, T) float64 additive bias of query a and key b (any value above the diagonal), or None;
    factor(layer, n) → (H, T) float64 multiplier of the content logits q·k/√Dh of query a (n = a + 1 keys), or None;
    inv_freq: (Dh/2,) float64 rotary frequencies applied to q and k (RoPE), or a function of the layer giving them
    or None (that layer does not rotate), or None;
    visible(layer, T) → (T, T) bool, whether query a sees key b (a window; the caller includes the causal mask), or
    None: causal;
    sink(layer) → (H,) float64 logits that join each softmax's denominator and carry no value, or None (per layer too);
    qk_norm(layer) → None, or (q_gain, k_gain, eps): q and k of each head RMS-normalised before the rotation, each
    gain (Dh,) float64 or None (no gain)."""
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
        norm = qk_norm(layer) if qk_norm is not None else None
        if norm is not None:
            q, k = rms_norm(q, norm[0], norm[2]), rms_norm(k, norm[1], norm[2])
        freq = inv_freq(layer) if callable(inv_freq) else inv_freq
        if freq is not None:
            q, k = rope_by_hand(q, pos, freq), rope_by_hand(k, pos, freq)
        scores = q @ k.transpose(1, 2) / math.sqrt(Dh)  # (H, T, T)
        if factor is not None:
            scores = scores * factor(layer, n)[:, :, None]
        if bias is not None:
            scores = scores + bias(layer, pos)
        seen = causal if visible is None else visible(layer, T)  # (T, T)
        scores = scores.masked_fill(~seen, float("-inf"))
        logit = sink(layer) if sink is not None else None
        if logit is None:
            attn = scores.softmax(-1)  # (H, T, T)
        else:  # one more column, the sink's logit, in each softmax; then dropped
            column = logit.double()[:, None, None].expand(H, T, 1)
            attn = torch.cat((scores, column), dim=-1).softmax(-1)[..., :T]  # (H, T, T)
        y = (attn @ v).transpose(0, 1).reshape(T, D)  # (T, D)
        x = x + y @ block.attn.proj.weight.double().T
        h = layer_norm(x, block.ln2)
        fc, out = block.mlp[0], block.mlp[2]
        h = torch.nn.functional.gelu(h @ fc.weight.double().T + fc.bias.double())
        x = x + h @ out.weight.double().T + out.bias.double()
    return layer_norm(x, model.ln_f) @ model.tok.weight.double().T  # (T, V)
