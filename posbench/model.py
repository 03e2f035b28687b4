"""A decoder-only GPT (pre-LayerNorm, GELU MLP, tied embeddings) that knows no positional scheme by name.

One recipe for every scheme (docs/design.md §2), so that a comparison differs in positions only: token
embeddings are multiplied by sqrt(D) before the scheme adds any positions (fairseq's ``embed_scale``, the
code of the ALiBi paper; Vaswani et al. 2017, §3.4), weights start as in GPT-2, and the head is tied.

The positional scheme is a module handed in at construction; the model calls its hooks (``embed``,
``rotation``/``rotate``, ``score_mod``; see posbench/positional.py) and nothing else. Once per forward pass
the model builds an attention context (posbench/attention.py: the positions, the scheme's rotation tables,
the attention kernel and its bias or masks), which every layer shares; each layer hands its q, k, v to
``attention.attend``: causal SDPA when the scheme has no bias, otherwise a kernel chosen for the scheme and
device (FlexAttention on CUDA; ALiBi folded into SDPA on CPU) that never materialises a (B, H, T, T) tensor.

    scheme = build_scheme("alibi", d_model=128, n_head=4)
    model = GPT(vocab_size=4096, n_layer=4, n_head=4, d_model=128, d_ff=512, scheme=scheme)
    logits = model(idx)  # idx: (B, T) int64 → (B, T, V)
    nll = model(idx, targets=targets)  # targets: (B, T) int64 → (B, T) NLL of each target, in nats

Given targets, the model returns each target's NLL instead of logits; on CPU :class:`HeadNLL` computes the
head's logits, their log-sum-exp and the loss gradient chunk by chunk while each chunk is in cache, which
takes about a third less time than logits + ``cross_entropy`` for model=tiny's head and loss.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from posbench import attention
from posbench.schemes.base import PositionalScheme


class HeadNLL(torch.autograd.Function):
    """Per-token negative log-likelihood under softmax(h·Wᵀ): the tied head and the loss in one op.

    forward(h: (N, D) float32, weight: (V, D) float32, targets: (N,) int64, rows: int, need_grad: bool) → (N,)
    NLL in nats, equal to ``cross_entropy(h @ weight.T, targets, reduction="none")``. For every chunk of
    ``rows`` rows it computes the logits z and NLL_n = logsumexp_v(z_nv) − z_n,y_n; with ``need_grad`` it also
    turns the chunk, while it is in cache, into the gradient ∂NLL_n/∂z_nv = softmax(z_n)_v − [v = y_n] (the
    softmax cross-entropy gradient), kept in one (N, V) buffer. Backward then needs two matmuls; the incoming
    per-token gradient g scales the small (N, D) operands, never the (N, V) buffer. The buffer is the size of the
    logits it replaces, so training memory is unchanged; without ``need_grad`` (evaluation) only one chunk of
    logits exists at a time, in one reused buffer.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, rows, need_grad):
        n = h.shape[0]
        grad = torch.empty(n if need_grad else min(n, rows), weight.shape[0], dtype=h.dtype, device=h.device)  # (N or c, V)
        nll = torch.empty(n, dtype=h.dtype, device=h.device)  # (N,)
        for s in range(0, n, rows):
            y = targets[s:s + rows, None]  # (c, 1)
            z = torch.mm(h[s:s + rows], weight.t(), out=grad[s:s + rows] if need_grad else grad[: len(y)])  # (c, V) logits
            z_y, top = z.gather(1, y), z.amax(dim=1, keepdim=True)  # (c, 1) each
            total = z.sub_(top).exp_().sum(dim=1, keepdim=True)  # (c, 1): Σ_v exp(z_v − max)
            nll[s:s + rows] = (top + total.log() - z_y).squeeze(1)  # log-sum-exp − z_y
            if need_grad:
                z.mul_(total.reciprocal()).scatter_add_(1, y, torch.full_like(total, -1.0))  # softmax − one-hot
        ctx.save_for_backward(h, weight, grad)
        return nll

    @staticmethod
    def backward(ctx, g):  # g: (N,)
        h, weight, grad = ctx.saved_tensors
        g = g[:, None]  # (N, 1)
        return (grad @ weight) * g, grad.t() @ (h * g), None, None, None  # ∂/∂h (N, D), ∂/∂W (V, D)


class Attention(nn.Module):
    """Causal multi-head self-attention whose positions come from the shared scheme, through the context
    of the forward pass (posbench/attention.py: kernel, rotation tables, bias; dropout included)."""

    def __init__(self, d_model: int, n_head: int, scheme: PositionalScheme):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.scheme = [scheme]  # a list, so the shared scheme is registered once, in GPT

    def forward(self, x: torch.Tensor, ctx: attention.Context) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, D // self.n_head).permute(2, 0, 3, 1, 4)  # 3 × (B, H, T, Dh)
        q, k = self.scheme[0].rotate(q, k, ctx.rotation)
        y = attention.attend(q, k, v, ctx)  # (B, H, T, Dh)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))  # (B, T, D)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model, n_head, d_ff, dropout, scheme):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head, scheme)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model), nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, ctx):
        x = x + self.drop(self.attn(self.ln1(x), ctx))
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
        self.scheme, self.n_head, self.dropout = scheme, n_head, dropout
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

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                last: int | None = None) -> torch.Tensor:
        """idx: (B, T) int64 token ids; pos: (T,) absolute positions, default 0…T−1 → logits (B, T, V) (``last``: of
        the last ``last`` positions only, (B, last, V), so that a probe scoring a few tokens keeps no (B, T, V)), or, given
        targets (B, T) int64, each target's NLL in nats (B, T) float32 (from float32 logits whatever autocast
        does; on CPU through :class:`HeadNLL`, without a (B·T, V) logits tensor)."""
        if pos is None:
            pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.scheme.embed(self.tok(idx) * self.embed_scale, pos))  # (B, T, D)
        # once per pass, shared by every layer: the attention kernel, rotation tables, bias blocks
        ctx = attention.context(self.scheme, pos, self.n_head, x.dtype, self.dropout if self.training else 0.0)
        for block in self.blocks:
            x = block(x, ctx)
        x = self.ln_f(x)  # (B, T, D)
        if targets is None:
            return self.head(x if last is None else x[:, -last:])  # (B, T, V) or (B, last, V)
        if x.device.type == "cpu" and x.dtype == torch.float32:
            rows = max(1, 2**20 // self.head.weight.shape[0])  # a chunk of logits: 4 MiB of float32
            need_grad = torch.is_grad_enabled() and (x.requires_grad or self.head.weight.requires_grad)
            nll = HeadNLL.apply(x.flatten(0, 1), self.head.weight, targets.flatten(), rows, need_grad)  # (B·T,)
        else:
            nll = nn.functional.cross_entropy(self.head(x).float().flatten(0, 1), targets.flatten(), reduction="none")
        return nll.view(targets.shape)  # (B, T)
