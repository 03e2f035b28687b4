"""Memory a run needs, estimated before it starts: one training step, or one evaluation forward pass, in bytes.

A run whose step cannot fit (``train.seq_len=100000`` on model=tiny: terabytes) should be refused with the figure,
not left to swap for hours. The job knows the model spec, the batch, the length and the device before it builds
anything; this module turns them into a byte count and compares it with what the device can give now:

    kernel = kernel_for(spec["scheme"]["name"], "cpu", training=True)     # one of choice.KERNELS
    parts = step_bytes(spec, batch_size=16, seq_len=128, kernel=kernel)    # {"weights": …, …, "total": …} bytes
    parts = step_bytes(spec, 16, 128, kernel=None, device="cpu")           # each layer's kernel (hybrid layers)
    check_fits(spec, 16, 100000, kernel, "cpu", "train.seq_len=100000 × train.batch_size=16")  # MemoryTooSmall

The parts are weights, the optimizer's state, the activations autograd keeps (counted from posbench/model/blocks.py), what
the attention kernel keeps, and the logits; docs/design.md §5.7 gives each formula and what is not counted. A model
whose layers differ (a hybrid's global scheme, a local layer's window, sinks: :func:`layer_kernels`) is counted
layer group by layer group; a chunked window's kernel runs on its chunks, a batch of ⌈T/C⌉ times as many windows of
C tokens, and a sliding one's keeps what its query blocks and their W − 1 earlier keys need.
tests/test_memory.py checks the estimate against measured memory.
"""

from __future__ import annotations

import dataclasses

import torch

from posbench.attention import blockwise, choice, dense, dispatch, flex
from posbench.attention.windows import Window, expand_pattern
from posbench.config.schema import DEFAULT_SCHEME
from posbench.config.upgrade import model_section
from posbench.model import head
from posbench.model.build import build_model
from posbench.runtime import free_memory
from posbench.schemes import SCHEMES

GiB = 1 << 30
LSE_BYTES = 4  # the fused kernels' log-sum-exp is float32 whatever the activations' dtype
LOGIT_BYTES = 4  # the model computes the loss from float32 logits whatever autocast does (posbench/model/gpt.py)
BLOCK_TEMPORARIES = 2  # dense, math path: block-sized tensors alive while one block is computed (see docstring)
CONTEXT_TEMPORARIES = 16  # contextual: block-sized float32 values alive at once while one block is computed


class MemoryTooSmall(ValueError):
    """The estimated memory of a step exceeds what the device can give; the message is one line with both."""


def step_bytes(spec: dict, batch_size: int, seq_len: int, kernel: str | None, dtype_bytes: int = 4,
               training: bool = True, device: torch.device | str | None = None) -> dict[str, int]:
    """The estimated peak memory, in bytes, of one training step (forward, loss, backward, AdamW step) or, with
    ``training=False``, of one evaluation forward pass of the model ``spec`` describes, on a batch of
    ``batch_size`` × ``seq_len`` tokens with the attention ``kernel`` (:func:`kernel_for`) in every layer, or, None,
    each layer's own (:func:`layer_kernels`, on ``device``, CPU if None), on ``device`` (the logits and the contextual
    kernel's blocks depend on it: None counts CUDA's logits, the larger, and CPU blocks).
    docs/design.md §5.7 says what each part counts.
    Returns {"weights", "optimizer", "activations", "attention", "logits", "total"} in bytes."""
    m = _model_sizes(spec)
    params = parameter_count(spec, seq_len)
    parts = {
        "weights": params * dtype_bytes,
        "optimizer": 3 * params * dtype_bytes if training else 0,  # gradients, AdamW's exp_avg and exp_avg_sq
        "activations": _activation_bytes(m, batch_size, seq_len, dtype_bytes, training),
        "attention": (_attention_bytes(spec, m, batch_size, seq_len, kernel, dtype_bytes, training, device)
                      if kernel is not None else
                      _layered_bytes(spec, m, batch_size, seq_len, dtype_bytes, training, device)),
        "logits": _logit_bytes(batch_size * seq_len, spec["vocab_size"], device, dtype_bytes, training),
    }
    parts["total"] = sum(parts.values())
    return parts


def check_fits(spec: dict, batch_size: int, seq_len: int, kernel: str | None, device: torch.device | str, what: str,
               training: bool = True, dtype_bytes: int = 4) -> None:
    """Raise :class:`MemoryTooSmall` when :func:`step_bytes` exceeds what ``device`` can give now
    (posbench/runtime/free_memory.py).

    ``what`` leads the message and names the settings to lower, e.g. "train.seq_len=100000 × train.batch_size=16"
    (keys joined by " × ")."""
    parts = step_bytes(spec, batch_size, seq_len, kernel, dtype_bytes, training, device)
    free, source = free_memory.available_bytes(device)
    if parts["total"] <= free:
        return
    largest = sorted((k for k in parts if k != "total"), key=parts.get, reverse=True)[:3]
    if kernel is None:
        kernel = "/".join(dict.fromkeys(k for k, _, _ in layer_kernels(spec, device, training, seq_len=seq_len)))
    detail = ", ".join(f"{k} {_size(parts[k])}" + (f" with the {kernel} kernel" if k == "attention" else "")
                       for k in largest)
    keys = " or ".join(part.split("=")[0].strip() for part in what.split("×"))
    step = "a training step" if training else "an evaluation forward pass"
    raise MemoryTooSmall(f"{what}: {step} needs about {_size(parts['total'])} ({detail}), and this machine has "
                         f"{_size(free)} available ({source}); lower {keys}")


def kernel_for(scheme_name: str, device: torch.device | str, training: bool, dropout: float = 0.0) -> str:
    """The attention kernel of a model of one scheme (every layer global, no sink): :func:`layer_kernels`' of the
    scheme registered as ``scheme_name``, training with attention dropout ``dropout`` or evaluating."""
    spec = {"scheme": {"name": scheme_name}, "model": {"n_layer": 1, "attn_dropout": dropout}}
    return layer_kernels(spec, device, training)[0][0]


def layer_kernels(spec: dict, device: torch.device | str, training: bool, dropout: float | None = None,
                  seq_len: int | None = None) -> list[tuple[str, int | None, object]]:
    """Each layer's attention (posbench/attention/dispatch.py ``context``, from the schemes' class attributes: positions
    0…T−1 assumed) as (kernel, chunk, scheme class): the kernel ``choose_kernel`` picks for the layer's scheme (the
    global one on a G layer), its window where it hides keys at ``seq_len`` (all, if None), sinks, and ``dropout``
    (None: the spec's ``attn_dropout``); ``chunk``: C where a chunked window runs the kernel on its chunks, else
    None. Training: gradients on, CUDA under bfloat16 autocast; evaluation: float32, no dropout. It reads the
    schemes' class attributes only, so no scheme is built (FIRE within its threshold counts as a bias of i and j)."""
    m, device = _model_sizes(spec), torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" and training else torch.float32
    dropout = (m["attn_dropout"] if dropout is None else dropout) if training else 0.0
    kinds = expand_pattern(m["layer_pattern"], m["n_layer"])
    out = []
    for kind in kinds:
        section = m["global_scheme"] if kind == "G" and m["global_scheme"] else spec.get("scheme") or {}
        cls = SCHEMES[section.get("name", DEFAULT_SCHEME)]
        window = Window(m["window"], m["window_kind"]) if kind == "L" and m["window"] else None
        window = window if window is not None and (seq_len is None or window.binds(seq_len)) else None
        chunked = window is not None and window.kind == "chunked" and choice.chunks_batch(cls)  # (a batch of chunks)
        out.append((choice.choose_kernel(cls, device, dtype, dropout, training, window=None if chunked else window,
                                         sink=m["attn_sink"]), window.size if chunked else None, cls))
    return out


def parameter_count(spec: dict, seq_len: int) -> int:
    """Parameters of the model ``spec`` describes (tied embeddings once), built by ``posbench.model.build.build_model`` on
    the meta device (one scheme per layer where its Config says ``per_layer``): no memory, no random numbers drawn.
    A scheme option still None is filled from ``seq_len`` (the learned table: 16 × L)."""
    m = _model_sizes(spec)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        options = dataclasses.asdict(_scheme(spec, m, seq_len).config)  # filled from L
        model = build_model({**spec, "scheme": {"name": _scheme_name(spec), **options}})
    return sum(p.numel() for p in model.parameters())


# ---- the parts ------------------------------------------------------------------------------------------------


def _layered_bytes(spec: dict, m: dict, B: int, T: int, b: int, training: bool, device=None) -> int:
    """The attention part of a model whose layers may differ (:func:`layer_kernels`): per group of layers with one
    kernel, scheme and window, :func:`_attention_bytes` of that many layers (a chunked window's on its chunks, a batch
    of ⌈T/C⌉·B windows of C tokens; a sliding window's through ``window``)."""
    groups: dict[tuple, int] = {}
    kinds = expand_pattern(m["layer_pattern"], m["n_layer"])
    for kind, (kernel, chunk, _) in zip(kinds, layer_kernels(spec, device or "cpu", training, seq_len=T)):
        sliding = m["window"] if kind == "L" and m["window"] and chunk is None and m["window"] < T else None
        key = (kernel, chunk, "G" if kind == "G" and m["global_scheme"] else "L", sliding)
        groups[key] = groups.get(key, 0) + 1
    total = 0
    for (kernel, chunk, which, sliding), layers in groups.items():
        section = m["global_scheme"] if which == "G" else spec.get("scheme") or {}
        own = {**spec, "scheme": section, "model": {**spec.get("model", {}), "n_layer": layers}}
        sizes = {**m, "n_layer": layers}
        if chunk:
            total += _attention_bytes(own, sizes, B * -(-T // chunk), chunk, kernel, b, training, device)
        else:
            total += _attention_bytes(own, sizes, B, T, kernel, b, training, device, window=sliding)
    return total


def _activation_bytes(m: dict, B: int, T: int, b: int, training: bool) -> int:
    """Saved for backward (training) or alive in one layer (evaluation), per docs/design.md §5.7: per token, the norms'
    inputs 2·D, the inputs of qkv and the MLP 2·D, of proj A, the qkv output A + 2·KV, rotated q and k A + KV, the
    attention output A (A = H·Dh the queries' width, KV = H_kv·Dh), the keys and values repeated for the query heads
    they serve 2·A (grouped-query attention only), the MLP's hidden vectors 2·F (GELU's) or 4·F (SwiGLU's)."""
    D, F = m["d_model"], m["d_ff"]
    A, KV = m["n_head"] * _head_dim(m), (m["n_kv_head"] or m["n_head"]) * _head_dim(m)
    extra = 4 * A + 3 * KV - 7 * D + (2 * A if KV < A else 0)  # 0 for GPT-2's heads: 11·D in all
    if not training:
        return B * T * (9 * D + (2 if m["block"] == "gpt" else 3) * F + extra) * b
    per_layer = (11 * D + (2 if m["block"] == "gpt" else 4) * F + 4 + extra) * b  # per token
    return B * T * (m["n_layer"] * per_layer + 2 * D * b)


def _head_dim(m: dict) -> int:  # a head's width Dh: model.head_dim, or D / H
    return m["head_dim"] or m["d_model"] // m["n_head"]


def _logit_bytes(N: int, V: int, device, b: int, training: bool) -> int:
    """The head and loss over N = B·T targets, per the module docstring."""
    if device is not None and torch.device(device).type == "cpu" and b == 4:  # HeadNLL (posbench/model/head.py)
        return N * V * LOGIT_BYTES if training else min(N * V, head.HEAD_CHUNK_ELEMENTS) * LOGIT_BYTES + N * LOGIT_BYTES
    return 2 * N * V * LOGIT_BYTES  # (N, V): log_softmax's output and the float32 logits (their gradient)


def _attention_bytes(spec: dict, m: dict, B: int, T: int, kernel: str, b: int, training: bool, device=None,
                     window: int | None = None) -> int:
    """The kernel's own part, per the module docstring; ``window``: a sliding window of that many tokens."""
    L, H, Dh = m["n_layer"], m["n_head"], _head_dim(m)
    lse = B * H * T * LSE_BYTES  # (B, H, T) per layer
    if window is not None and kernel == "banded":  # blocks of WINDOW_QUERIES against their W − 1 earlier keys
        Q = min(dense.WINDOW_QUERIES, T)
        pattern = H * Q * (Q + window) * b  # the table and its mask pattern (a view of (H, 2Q + W))
        if not training:
            return 3 * H * T * b + pattern + B * H * (T + 2 * Q) * Dh * b + lse
        if not _bias_graph(spec, m, T)[1]:  # SDPA's fused kernel: each layer's outputs joined, their lse
            return L * (lse + B * H * T * Dh * b) + pattern
        # a mask that needs a gradient (T5, KERPLE) sends SDPA to its math path: each layer keeps its blocks'
        # probabilities (B, H, Q, Q + W − 1) and copies of q, k, v; one block's scores and probabilities beside
        pairs = T * (Q + window - 1)
        return L * B * H * (pairs + 3 * T * Dh) * b + BLOCK_TEMPORARIES * B * H * Q * (Q + window) * b + pattern
    if window is not None and kernel == "dense":  # the (query, key) pairs of its blocks in place of the triangle's
        return _dense_bytes(spec, m, B, T, b, training, Window(window))
    if window is not None and kernel == "contextual":
        return _contextual_bytes(spec, m, B, T, training, device, Window(window))
    if kernel == "flex" and training and (not SCHEMES[_scheme_name(spec)].distance_table
                                          or flex.OPTIONS.table_layout == "pair"):
        per_pair, learned = _bias_graph(spec, m, T)
        if learned:  # dispatch.context builds the per-pair table (H, T, T) of each scheme instance (FIRE; T5 and
            # KERPLE in flex.OPTIONS's pair layout)
            copies = L if _per_layer(spec) else 1
            return L * lse + int(copies * T * T * (2 * H * 4 + per_pair))  # table, its gradient, its graph
    if kernel in ("causal", "flex"):
        return L * lse if training else lse
    if kernel == "folded":
        Dh1 = Dh + 1
        if not training:
            return 4 * B * H * T * Dh1 * b + lse  # q', k', v', y: (B, H, T, Dh+1)
        keys = sum(e for _, e in _fold_blocks(T))  # Σ end: the keys copied for each query block
        return L * (B * H * Dh1 * (3 * T + keys) * b + lse)
    if kernel == "banded":  # evaluation: table and pattern, one block's mask, the output and a block's partials
        Q = min(blockwise.FOLD_QUERIES, T)
        return (3 * H * T + H * Q * T) * b + B * H * (T + 2 * Q) * Dh * b + lse
    if kernel == "dense":
        return _dense_bytes(spec, m, B, T, b, training)
    if kernel == "contextual":
        return _contextual_bytes(spec, m, B, T, training, device)
    raise ValueError(f"kernel={kernel!r}: not an attention kernel; choose one of {', '.join(choice.KERNELS)}")


def _dense_bytes(spec: dict, m: dict, B: int, T: int, b: int, training: bool, window: Window | None = None) -> int:
    """Dense kernel: per layer the probabilities (math path) or the masks (fused path), plus the bias's graph."""
    L, H, Dh = m["n_layer"], m["n_head"], _head_dim(m)
    blocks = dense.dense_blocks(T, H, window)  # [(start, end)]
    first = (lambda s: 0) if window is None else window.first_key
    pairs = sum((e - s) * (e - first(s)) for s, e in blocks)  # (query, key) pairs of all blocks: Σ Q·(end − first)
    block = max((e - s) * (e - first(s)) for s, e in blocks)  # the largest block's pairs
    once = H * (T * T if window is None else pairs) <= dense.BIAS_ELEMENTS  # masks built once per pass, or per layer
    copies = L if _per_layer(spec) else 1  # one set of masks per scheme instance
    mask = H * (pairs if once else block) * b * (copies if once else 1)  # masks alive at once (evaluation, forward)
    if not training:
        return 2 * mask + B * H * T * LSE_BYTES
    per_pair, needs_grad = _bias_graph(spec, m, T)
    graph = int(per_pair * pairs) * (copies if once else L)
    if not needs_grad:  # fused SDPA keeps each layer's masks (shared when built once) and log-sum-exp
        return H * pairs * b * (copies if once else L) + L * B * H * T * LSE_BYTES
    probs = L * (B * H * pairs + 3 * B * T * H * Dh) * b  # softmax output (B, H, Q, end) per block; q, k, v copies
    return probs + BLOCK_TEMPORARIES * B * H * block * b + graph + mask


def _contextual_bytes(spec: dict, m: dict, B: int, T: int, training: bool, device=None,
                      window: Window | None = None) -> int:
    """Contextual kernel: per layer what autograd keeps per (query, key) pair and per query (training), plus one
    block's temporaries; with a sliding ``window``, its blocks' pairs (keys from the window's first on)."""
    H = m["n_head"]
    blocks = dense.contextual_blocks(B, H, T, "cpu" if device is None else torch.device(device).type, window)
    first = (lambda s: 0) if window is None else window.first_key
    pairs = B * H * sum((e - s) * (e - first(s)) for s, e in blocks)  # scores of all blocks: Σ B·H·Q·keys
    block = B * H * max((e - s) * (e - first(s)) for s, e in blocks)  # the largest block's scores
    per_pair, per_query = _contextual_saved(spec, m, T)
    # float32 whatever the activations (16-bit scores are widened), and the block's per-query tables (CoPE's q·e)
    temporaries = CONTEXT_TEMPORARIES * block * 4 + int(per_query * B * H * (blocks[0][1] - blocks[0][0]))
    if not training:
        return temporaries
    return int(m["n_layer"] * (per_pair * pairs + per_query * B * H * T)) + temporaries


def _contextual_saved(spec: dict, m: dict, seq_len: int) -> tuple[float, float]:
    """(bytes per (query, key) pair, bytes per query and head) that autograd keeps in the contextual kernel beyond
    q, k, v and the scheme's parameters: fitted to two blocks measured under ``saved_tensors_hooks``, 32 and 64
    queries against as many keys, float32, with the spec's scheme built on the CPU (options filled from
    ``seq_len``). Per query: what does not grow with the keys (CoPE: q·e of each integer position)."""
    H, Dh = m["n_head"], _head_dim(m)
    with torch.random.fork_rng(devices=[]):
        scheme = _scheme(spec, m, seq_len)
        inputs = {T: [torch.randn(1, H, T, Dh, requires_grad=True) for _ in range(3)] for T in (32, 64)}
    kept = {}
    for T, (q, k, v) in inputs.items():
        skip = {t.untyped_storage().data_ptr() for t in (q, k, v, *scheme.parameters())}
        saved: dict[tuple[int, int], int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in skip:
                saved[(t.untyped_storage().data_ptr(), t.numel())] = t.numel() * t.element_size()
            return t

        ctx = dispatch.context(scheme, torch.arange(T), H, kernel="contextual")
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            dispatch.attend(q, k, v, ctx)
        kept[T] = sum(saved.values())  # = per_pair · H·T² + per_query · H·T
    per_pair = (kept[64] / 64 - kept[32] / 32) / (H * 32)
    return per_pair, max(0.0, kept[32] / (H * 32) - per_pair * 32)


def _bias_graph(spec: dict, m: dict, T: int) -> tuple[float, bool]:
    """(bytes autograd keeps per (query, key) pair while building a dense bias block, whether the bias needs a
    gradient), measured on one small block: queries 32…63 against keys 0…63 of a scheme built on the CPU."""
    if not SCHEMES[(spec.get("scheme") or {}).get("name", DEFAULT_SCHEME)].has_bias:
        return 0.0, False  # no bias to build (and a learned table is not built for nothing)
    with torch.random.fork_rng(devices=[]):
        scheme = _scheme(spec, m, T)
    saved: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[(t.untyped_storage().data_ptr(), t.numel())] = t.numel() * t.element_size()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        bias = blockwise.dense_mask(scheme, torch.arange(64), m["n_head"], 32, 64, torch.float32)  # (H, 32, 64)
    n = 32 * 64
    kept = sum(size for (_, numel), size in saved.items() if numel >= n)  # the tensors that grow with the block
    return kept / n, bias.requires_grad


# ---- helpers --------------------------------------------------------------------------------------------------


def _model_sizes(spec: dict) -> dict:
    """The spec's model section over ModelConfig's defaults (as posbench.model.build.build_model reads it)."""
    return model_section(spec.get("model", {}))


def _scheme_name(spec: dict) -> str:
    return (spec.get("scheme") or {}).get("name", DEFAULT_SCHEME)


def _scheme(spec: dict, m: dict, seq_len: int):
    """The scheme of ``spec``, built on the current default device, its unset options filled from ``seq_len``."""
    options = dict(spec.get("scheme") or {})
    cls = SCHEMES[options.pop("name", DEFAULT_SCHEME)]
    config = cls.make_config(**options)
    config.fill(seq_len)
    return cls(m["d_model"], m["n_head"], config, m["head_dim"])


def _per_layer(spec: dict) -> bool:
    """Whether the spec's scheme is built once per layer (its Config's ``per_layer``, default included)."""
    options = dict(spec.get("scheme") or {})
    return bool(getattr(SCHEMES[options.pop("name", DEFAULT_SCHEME)].make_config(**options), "per_layer", False))


def _fold_blocks(T: int) -> list[tuple[int, int]]:
    """The folded kernel's query blocks (posbench/attention/dispatch.py ``context``)."""
    return [(s, min(T, s + blockwise.FOLD_QUERIES)) for s in range(0, T, blockwise.FOLD_QUERIES)]


def _size(n: float) -> str:
    """Bytes as MiB, GiB or TiB with one decimal."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / (1 << 20):.1f} MiB"
