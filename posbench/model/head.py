"""The tied head and the loss in one op: :class:`HeadNLL`, and when the model uses it (:func:`head_dtype`).

On CPU :class:`HeadNLL` computes the head's logits, their log-sum-exp and the loss gradient chunk by chunk while each
chunk is in cache, which takes about a third less time than logits + ``cross_entropy`` for model=tiny's head and
loss. On CUDA it does so too, with each chunk's logits in autocast's dtype, where :data:`CHUNKED_HEAD_CUDA` is set (off
until a GPU probe has timed it against the bf16 logits upcast to float32 that CUDA computes otherwise).

    nll = HeadNLL.apply(h, weight, targets, head_rows(h.device, V), True, head_dtype(h.device, h.dtype, False))
"""

from __future__ import annotations

import torch

CHUNKED_HEAD_CUDA = False  # HeadNLL on CUDA too (:func:`head_dtype`): off until a GPU probe has timed it against logits
HEAD_CHUNK_ELEMENTS = 2**20  # logits per HeadNLL chunk on CPU: 4 MiB of float32, in cache
HEAD_CHUNK_ELEMENTS_CUDA = 2**24  # logits per HeadNLL chunk on CUDA (fewer, larger launches): 64 MiB of float32


def head_dtype(device: torch.device, dtype: torch.dtype, chunked_cuda: bool, autocast: torch.dtype | None = None
               ) -> torch.dtype | None:
    """How the model computes its head and loss given targets, for final activations of ``dtype`` on ``device``
    (its type alone counts: CPU tensors may take CUDA's path in tests) under ``autocast`` (its dtype, or None):
    the dtype of :class:`HeadNLL`'s chunk matmuls, or None for logits + ``cross_entropy`` (a (B·T, V) tensor, upcast
    to float32). float32 on CPU for float32 activations (autocast or not: the head as today); on CUDA with
    ``chunked_cuda`` (:data:`CHUNKED_HEAD_CUDA`) and float32 activations (LayerNorm's output under autocast),
    autocast's dtype, or float32 without autocast; else None."""
    if dtype != torch.float32:
        return None
    if device.type == "cpu":
        return torch.float32
    return (autocast or torch.float32) if device.type == "cuda" and chunked_cuda else None


def head_rows(device: torch.device, vocab: int) -> int:
    """Rows of each :class:`HeadNLL` chunk: :data:`HEAD_CHUNK_ELEMENTS` logits on CPU, :data:`HEAD_CHUNK_ELEMENTS_CUDA`
    on CUDA, of a vocabulary of ``vocab``, at least 1."""
    return max(1, (HEAD_CHUNK_ELEMENTS_CUDA if device.type == "cuda" else HEAD_CHUNK_ELEMENTS) // vocab)


class HeadNLL(torch.autograd.Function):
    """Per-token negative log-likelihood under softmax(h·Wᵀ): the tied head and the loss in one op.

    forward(h: (N, D) float32, weight: (V, D) float32, targets: (N,) int64, rows: int, need_grad: bool,
    mm_dtype: torch.dtype | None = None) → (N,) NLL in nats, equal to ``cross_entropy(h @ weight.T, targets,
    reduction="none")``. For every chunk of ``rows`` rows it computes the logits z and NLL_n = logsumexp_v(z_nv) −
    z_n,y_n; with ``need_grad`` it also turns the chunk, while it is in cache, into the gradient ∂NLL_n/∂z_nv =
    softmax(z_n)_v − [v = y_n] (the softmax cross-entropy gradient), kept in one (N, V) buffer. Backward then needs
    two matmuls; the incoming per-token gradient g scales the small (N, D) operands, never the (N, V) buffer. The
    buffer is the size of the logits it replaces, so training memory is unchanged; without ``need_grad``
    (evaluation) only one chunk of logits exists at a time, in one reused buffer.

    ``mm_dtype`` other than h's (bfloat16: CUDA under autocast, :func:`head_dtype`): autocast's precision without its
    (N, V) logits. Each chunk's logits come from a matmul of h and weight cast to ``mm_dtype`` (as autocast's linear
    computes them), their log-sum-exp, NLL and gradient in float32; the gradient buffer (N, V) is in ``mm_dtype``
    (half the float32 logits that the upcast path keeps besides its bf16 ones), and backward's two matmuls run in it
    too, their results cast back to h's and weight's dtypes, as autocast's linear backward does. Autocast is off
    inside (every cast explicit), so the result is the same with or without it.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, rows, need_grad, mm_dtype=None):
        if mm_dtype is not None and mm_dtype != h.dtype:
            return HeadNLL._forward_cast(ctx, h, weight, targets, rows, need_grad, mm_dtype)
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
    def _forward_cast(ctx, h, weight, targets, rows, need_grad, mm_dtype):
        """forward with chunk matmuls in ``mm_dtype`` and the rest in float32 (the class docstring)."""
        n = h.shape[0]
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(mm_dtype).t()  # (D, V)
            grad = torch.empty(n if need_grad else 0, weight.shape[0], dtype=mm_dtype, device=h.device)  # (N or 0, V)
            nll = torch.empty(n, dtype=torch.float32, device=h.device)  # (N,)
            for s in range(0, n, rows):
                y = targets[s:s + rows, None]  # (c, 1)
                z = torch.mm(h[s:s + rows].to(mm_dtype), w).float()  # (c, V) logits of mm_dtype, in float32
                z_y, top = z.gather(1, y), z.amax(dim=1, keepdim=True)  # (c, 1) each
                total = z.sub_(top).exp_().sum(dim=1, keepdim=True)  # (c, 1): Σ_v exp(z_v − max)
                nll[s:s + rows] = (top + total.log() - z_y).squeeze(1)  # log-sum-exp − z_y
                if need_grad:  # softmax − one-hot, rounded to mm_dtype
                    grad[s:s + rows] = z.mul_(total.reciprocal()).scatter_add_(1, y, torch.full_like(total, -1.0))
        ctx.save_for_backward(h, weight, grad)
        return nll.to(h.dtype)

    @staticmethod
    def backward(ctx, g):  # g: (N,)
        h, weight, grad = ctx.saved_tensors
        g = g[:, None]  # (N, 1)
        if grad.dtype == h.dtype:
            return (grad @ weight) * g, grad.t() @ (h * g), None, None, None, None  # ∂/∂h (N, D), ∂/∂W (V, D)
        with torch.autocast(h.device.type, enabled=False):  # matmuls in grad's dtype (mm_dtype), as autocast's
            d_h = (grad @ weight.to(grad.dtype)).to(h.dtype) * g  # (N, D)
            d_w = grad.t() @ (h * g).to(grad.dtype)  # (V, D)
        return d_h, d_w.to(weight.dtype), None, None, None, None
