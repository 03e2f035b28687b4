"""Local layers: which layers of a model are local (its layer pattern, :func:`expand_pattern`) and which keys a
local layer's query sees, on top of the causal mask (its attention window, :class:`Window`; docs/design.md §2).

A window is part of the attention's mask, not of a positional scheme: the same RoPE layer may attend to every
earlier key (a global layer) or to a window of them (a local layer). Indices are a window's token indices 0…T−1,
whatever positions the scheme reads (causal by index, as every kernel is):

* ``sliding`` (Mistral, Gemma 2/3, Cohere 2, GPT-OSS; Hugging Face's ``sliding_window_overlay``): query i sees key j
  when 0 ≤ i − j < W, so each query sees its W most recent keys, itself included;
* ``chunked`` (Llama 4's chunked attention, ``chunked_overlay``): the sequence is cut into chunks of C = W tokens and
  query i sees key j when j ≤ i and ⌊j/C⌋ = ⌊i/C⌋: a query at the start of a chunk sees itself alone.

    w = Window(32, "sliding")
    w.visible(i[:, None], j[None, :])   # (Tq, Tk) bool, the causal mask included
    w.first_key(s)                      # the first key any query from s on sees: what a query block skips before

A sliding window is a bias of the distance i − j alone (0 below W, −inf from W on): posbench/attention/dispatch.py folds it
into a per-distance table where a scheme has one. A chunked window is causal attention within each chunk: the
kernels run it on the chunks as a batch where the bias allows (:func:`to_chunks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

WINDOW_KINDS = ("sliding", "chunked")  # model.window_kind


@dataclass(frozen=True)
class Window:
    """Which earlier keys a query sees (module docstring). ``size``: W ≥ 1 tokens (sliding) or the chunk length C
    (chunked); ``kind``: one of :data:`WINDOW_KINDS`. Raises ValueError for another kind or a size below 1."""

    size: int
    kind: str = "sliding"

    def __post_init__(self):
        if self.kind not in WINDOW_KINDS:
            raise ValueError(f"window kind {self.kind!r} is unknown; choose one of: {', '.join(WINDOW_KINDS)}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"window size {self.size!r} is not allowed: it must be an integer >= 1")

    def visible(self, i, j):
        """Whether query index ``i`` sees key index ``j`` (broadcastable int tensors or ints): causal ∧ window."""
        if self.kind == "sliding":
            return (j <= i) & (i - j < self.size)
        return (j <= i) & (j // self.size == i // self.size)

    def first_key(self, s: int) -> int:
        """The first key index that any query at index ≥ ``s`` may see: a query block starting at s skips the keys
        before it."""
        return max(0, s - self.size + 1) if self.kind == "sliding" else s // self.size * self.size

    def binds(self, T: int) -> bool:
        """Whether the window hides any key of a T-token window from a query that causal attention would show it:
        W < T (a sliding window or chunk of at least T tokens is causal attention)."""
        return self.size < T

    def label(self) -> str:
        """``w32`` (sliding) or ``c32`` (chunked), as run labels write it."""
        return f"{'w' if self.kind == 'sliding' else 'c'}{self.size}"


def to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """x: (B, H, T, Dh) → (B·n, H, C, Dh), n = ⌈T/C⌉: the chunks of C tokens as a batch, the last one padded with
    zeros after its tokens (a causal kernel never lets a real query see them)."""
    B, H, T, Dh = x.shape
    n = -(-T // C)
    x = F.pad(x, (0, 0, 0, n * C - T))  # (B, H, n·C, Dh)
    return x.view(B, H, n, C, Dh).transpose(1, 2).reshape(B * n, H, C, Dh)


def from_chunks(y: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """The inverse of :func:`to_chunks`: (B·n, H, C, Dh) → (B, H, T, Dh), the padding dropped."""
    Bn, H, C, Dh = y.shape
    return y.view(B, Bn // B, H, C, Dh).transpose(1, 2).reshape(B, H, -1, Dh)[:, :, :T]


PATTERN_LETTERS = "LG"  # model.layer_pattern: L a local layer (its window, the run's scheme), G a global one


def expand_pattern(pattern: str, n_layer: int) -> str:
    """``pattern`` (e.g. ``LLLG``) repeated and cut to ``n_layer`` letters, one per layer from the first: ``LLLG`` at
    6 layers is ``LLLGLL``, at 2 ``LL``. Raises ValueError for an empty pattern or a letter other than L and G."""
    bad = sorted(set(pattern) - set(PATTERN_LETTERS)) if isinstance(pattern, str) else None
    if not isinstance(pattern, str) or not pattern or bad:
        raise ValueError(f"layer_pattern={pattern!r} is not allowed: give a string of L (local layer) and G (global "
                         "layer), e.g. LLLG, repeated over the layers" + (f"; {bad[0]!r} is neither" if bad else ""))
    return (pattern * n_layer)[:n_layer]
