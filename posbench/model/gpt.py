"""A decoder-only causal LM that knows no positional scheme by name, built of GPT-2's blocks (pre-LayerNorm, GELU MLP:
the default) or Llama's (pre-RMSNorm, SwiGLU; posbench/model/blocks.py), with grouped-query attention and a tied or
untied head.

One recipe for every scheme (docs/design.md §2), so that a comparison differs in positions only. In the GPT block,
token embeddings are multiplied by sqrt(D) before the scheme adds any positions (fairseq's ``embed_scale``, the code
of the ALiBi paper; Vaswani et al. 2017, §3.4) and weights start as in GPT-2; in the Llama block, as in Llama, the
embeddings are not scaled and every weight starts N(0, 0.02²). The head is tied in both.

The positional scheme is a module handed in at construction (one shared by every layer, or one per layer for a
scheme built that way); the model calls its hooks (``embed``, ``rotation``/``rotate``, ``score_mod``; see
posbench/schemes/base.py) and nothing else. Once per forward pass and scheme instance the model builds an
attention context (posbench/attention/dispatch.py: the scheme, the positions, its rotation tables, the attention kernel and
its bias or masks), which the layers of that instance share; each layer hands its q, k, v to ``dispatch.attend``:
causal SDPA when the scheme has no bias, otherwise a kernel chosen for the scheme and device (FlexAttention on CUDA;
ALiBi folded into SDPA on CPU) that never materialises a (B, H, T, T) tensor. ``attn_scale`` multiplies each query
by a factor of its index (log-n scaling, Scalable-Softmax, the zero-shot temperatures: posbench/attention/temperature.py) before
any kernel runs.

    scheme = build_scheme("alibi", d_model=128, n_head=4)
    model = GPT(vocab_size=4096, n_layer=4, n_head=4, d_model=128, d_ff=512, scheme=scheme)
    logits = model(idx)  # idx: (B, T) int64 → (B, T, V)
    nll = model(idx, targets=targets)  # targets: (B, T) int64 → (B, T) NLL of each target, in nats

Given targets, the model returns each target's NLL instead of logits; on CPU ``head.HeadNLL`` (posbench/model/head.py)
computes the head's logits, their log-sum-exp and the loss gradient chunk by chunk while each chunk is in cache, which
takes about a third less time than logits + ``cross_entropy`` for model=tiny's head and loss. On CUDA it does so
too, with each chunk's logits in autocast's dtype, where ``head.CHUNKED_HEAD_CUDA`` is set (off until a GPU probe has
timed it against the bf16 logits upcast to float32 that CUDA computes otherwise; ``head.head_dtype`` chooses).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from posbench.attention import dispatch, temperature
from posbench.attention.windows import Window, expand_pattern
from posbench.config.model_checks import embeddings_scaled
from posbench.config.schema import BLOCKS
from posbench.model import head
from posbench.model.blocks import QK_NORM_EPS, Block, LlamaBlock, final_norm
from posbench.schemes.base import PositionalScheme

SINK_STD = 0.02  # attention sinks start N(0, 0.02²): Hugging Face's GPT-OSS initialisation (initializer_range)


class GPT(nn.Module):
    """Decoder-only causal language model with a pluggable positional scheme, its layers local or global.

    Args:
        vocab_size: V, tokens in the vocabulary.
        n_layer, n_head, d_model, d_ff: depth, heads H, width D, MLP hidden width.
        block: ``gpt`` (GPT-2's pre-LayerNorm block, the default) or ``llama`` (pre-RMSNorm, SwiGLU, no biases;
            posbench/model/blocks.py), with the final norm of its kind.
        n_kv_head: key/value heads (grouped-query attention; each serves n_head / n_kv_head query heads); None: H.
        head_dim: the width Dh of a head; None: D / H.
        tie_head: the head shares the token embeddings' weights (True: GPT-2's and posbench's recipe).
        qkv_bias: the query, key and value projections have biases (Qwen 2's).
        norm_eps: the epsilon of every LayerNorm or RMSNorm of the blocks (not QK-norm's).
        dropout: dropout probability on the embeddings and the residual branches (0 disables it).
        scheme: the positional scheme of the local (L) layers, and of the global (G) ones when ``global_scheme`` is
            None: one instance shared by them all, or a list of instances of one class, one per layer that uses it,
            in layer order (a scheme whose reference builds one per attention layer: ``scheme.per_layer``, FIRE's and
            CoPE's; posbench.model.build.build_model makes them). Registered as ``self.scheme``: the scheme itself
            (state-dict keys ``scheme.*``), or an ``nn.ModuleList`` (``scheme.<i>.*``).
        global_scheme: the G layers' scheme (an instance or a per-layer list of the G layers, as ``scheme``), of any
            class but one that embeds positions; ``self.global_scheme`` (``global_scheme.*``); None: ``scheme``.
        layer_pattern: which layers are local and which global: ``L`` and ``G`` letters repeated over the layers
            from the first (posbench.attention.windows.expand_pattern: ``LLLG`` at 4 layers, ``LG`` alternating); ``G``, the
            default, makes every layer global, the model as before.
        window, window_kind: the L layers' attention window (posbench/attention/windows.py): W ≥ 1 tokens of a ``sliding``
            window (query i sees key j when 0 ≤ i − j < W) or the chunk length of a ``chunked`` one (j ≤ i in the
            same chunk of W); None: the L layers attend to every earlier key.
        qk_norm: ``none``, or ``rms``: each head's query and key divided by their root mean square (RMSNorm, eps
            :data:`~posbench.model.blocks.QK_NORM_EPS` in the GPT block, ``norm_eps`` in the Llama block, as Qwen 3's
            and Gemma 3's) before any rotation (Dehghani et al. 2023; Gemma 3, OLMo 2, Qwen 3, Llama 4), on
            ``qk_norm_layers`` (``all``, or ``local``: the L layers, as Llama 4's RoPE layers), with a learned gain per
            head dimension when ``qk_norm_weight`` (initialised to 1), without one otherwise (Llama 4: then, for a plain
            rotation, RoPE's or p-RoPE's, which keeps each head's norm, it equals Llama 4's norm after the rotation).
        attn_sink: a learned logit per head and layer joins every softmax's denominator and is dropped
            (GPT-OSS's attention sinks; Xiao et al. 2023's sink as a parameter), initialised N(0, :data:`SINK_STD`²).
        scale_embeddings: multiply token embeddings by sqrt(D); None: the block's convention
            (``posbench.config.model_checks.embeddings_scaled``: yes in the GPT block, posbench's recipe for every
            scheme; no in the Llama block, Llama's). False in the GPT block is GPT-2's and nanoGPT's choice.
        attn_scale: length-dependent attention scaling, a factor on each query (``temperature.factor``), so on its
            logits q·k/√Dh (a ``score_mod`` bias is not scaled; CoPE's gates and position term, made from q, are),
            a function of the query's index t in the window, n = t + 1 the keys it sees (causal by index, whatever
            the positions): ``none`` (1: the model as before, bit for bit), ``log_n`` (ln n / ln L), ``ssmax``
            (s_h·ln n, s_h learned per head and layer, initialised to :data:`posbench.model.blocks.SSMAX_INIT`), and the zero-shot
            temperatures, 1 for every t < L: ``floor_log`` (Ministral 3), ``floor_log_n`` (Llama 4),
            ``log_n_clipped`` (ReRoPE, Self-Extend).
        scale_length: L of ``log_n`` and ``log_n_clipped``, F of ``floor_log`` and ``floor_log_n``; unused otherwise.
        scale_beta: β of ``floor_log`` and ``floor_log_n``, > 0.
        scale_layers: the layers a zero-shot temperature scales: ``all``, or ``global`` (the G layers of a pattern
            with L and G layers: Llama 4 scales its NoPE layers); ``log_n`` and ``ssmax`` scale every layer.
        attn_dropout: dropout probability on the attention probabilities, in [0, 1), in training mode only (0
            disables it). Any attention dropout moves a bias scheme off FlexAttention on CUDA, which has none
            (``choice.choose_kernel``).
    Raises:
        ValueError: an unknown ``block``; ``n_head`` does not divide ``d_model`` and no ``head_dim`` is given;
            ``n_kv_head`` does not divide ``n_head``; a list of schemes not as long as the layers that use it,
            of several classes, or of a class that embeds positions (it would add them once, before the first layer);
            a scheme that embeds positions beside a ``global_scheme``; a bad ``layer_pattern``; a window without an L
            layer, of size below 1 or of an unknown kind, or beside an ``attn_scale`` other than ``none``; a
            ``global_scheme`` without a G layer; an unknown ``attn_scale``, ``qk_norm`` or ``qk_norm_layers``, or
            ``local`` without an L layer; a ``scale_length`` or ``scale_beta`` the temperature refuses, or
            ``scale_layers=global`` but for a zero-shot temperature on a pattern with L and G layers; ``attn_dropout``
            outside [0, 1).

    Initialisation follows the block's model: GPT-2's (Radford et al. 2019, §2.3) in the GPT block, N(0, 0.02²) with
    the residual projections (the attention's ``proj``, the MLP's last map) scaled by 1/sqrt(2·n_layer); Llama's in
    the Llama block (transformers' LlamaPreTrainedModel, ``initializer_range`` 0.02), N(0, 0.02²) for every matrix and
    embedding, none scaled. In both, biases zero and norm gains one. The scheme's
    own parameters keep the initialisation it gave them; attention sinks are drawn last, so every other weight is the
    one a model without them draws.
    """

    def __init__(self, vocab_size: int, n_layer: int, n_head: int, d_model: int, d_ff: int,
                 scheme: PositionalScheme | list[PositionalScheme], dropout: float = 0.0, scale_embeddings: bool | None = None,
                 attn_scale: str = "none", scale_length: int | None = None, scale_beta: float = temperature.BETA,
                 scale_layers: str = "all", attn_dropout: float = 0.0,
                 global_scheme: PositionalScheme | list[PositionalScheme] | None = None, layer_pattern: str = "G",
                 window: int | None = None, window_kind: str = "sliding", qk_norm: str = "none",
                 qk_norm_layers: str = "all", qk_norm_weight: bool = True, attn_sink: bool = False,
                 block: str = "gpt", n_kv_head: int | None = None, head_dim: int | None = None, tie_head: bool = True,
                 qkv_bias: bool = False, norm_eps: float = 1e-5):
        super().__init__()
        if block not in BLOCKS:
            raise ValueError(f"block={block!r} is unknown; choose one of: {', '.join(BLOCKS)}")
        if head_dim is None and d_model % n_head:
            raise ValueError(f"n_head={n_head} does not divide d_model={d_model}")
        if attn_scale not in temperature.ATTN_SCALES:
            raise ValueError(f"attn_scale={attn_scale!r} is unknown; choose one of: {', '.join(temperature.ATTN_SCALES)}")
        if attn_scale != "none":
            temperature.factor(attn_scale, 1, scale_length, scale_beta)  # ValueError for a bad scale_length
        if attn_scale.startswith("floor_log") and not scale_beta > 0:
            raise ValueError(f"scale_beta={scale_beta!r}: the floor-log temperature needs beta > 0")
        if not 0 <= attn_dropout < 1:
            raise ValueError(f"attn_dropout={attn_dropout!r} is not a dropout probability, 0 <= p < 1")
        kinds = expand_pattern(layer_pattern, n_layer)  # one letter per layer
        users = n_layer if global_scheme is None else kinds.count("L")  # the layers of self.scheme
        self.windows = _windows(kinds, window, window_kind)  # per layer: a Window or None
        if window is not None and attn_scale in ("log_n", "ssmax"):
            raise ValueError(f"attn_scale={attn_scale!r} counts t + 1 keys per query, which window={window} caps in the "
                             "L layers: give one of them")
        if global_scheme is not None and "G" not in kinds:
            raise ValueError(f"global_scheme given, but layer_pattern={layer_pattern!r} has no G layer to use it")
        if global_scheme is not None and "L" not in kinds:
            raise ValueError(f"global_scheme given, but layer_pattern={layer_pattern!r} has no L layer: give the "
                             "scheme as scheme")
        self.scheme = _scheme_module(scheme, users, "scheme", embed_ok=global_scheme is None)
        self.global_scheme = None if global_scheme is None else _scheme_module(
            global_scheme, kinds.count("G"), "global_scheme", embed_ok=False)
        self.kinds = kinds
        if qk_norm not in dispatch.QK_NORMS or qk_norm_layers not in dispatch.QK_NORM_LAYERS:
            raise ValueError(f"qk_norm={qk_norm!r}, qk_norm_layers={qk_norm_layers!r}: choose qk_norm "
                             f"{' or '.join(dispatch.QK_NORMS)}, qk_norm_layers {' or '.join(dispatch.QK_NORM_LAYERS)}")
        if qk_norm == "rms" and qk_norm_layers == "local" and "L" not in kinds:
            raise ValueError(f"qk_norm_layers=local, but layer_pattern={layer_pattern!r} has no L layer")
        normed = [qk_norm == "rms" and (qk_norm_layers == "all" or kind == "L") for kind in kinds]
        if scale_layers not in temperature.SCALE_LAYERS or scale_layers == "global" and not (
                attn_scale in temperature.ZERO_SHOT and "L" in kinds and "G" in kinds):
            raise ValueError(f"scale_layers={scale_layers!r}: choose {' or '.join(temperature.SCALE_LAYERS)}; global "
                             "needs a zero-shot attn_scale and a layer_pattern with L and G layers")
        self.n_head, self.attn_dropout = n_head, attn_dropout
        self.attn_scale, self.scale_length, self.scale_beta = attn_scale, scale_length, scale_beta
        self.remap = None  # an evaluation's training-free extension (posbench/attention/remap.py), set after the model is built
        self.scaled = [attn_scale != "none" and (scale_layers == "all" or kind == "G") for kind in kinds]  # per layer
        self.embed_scale = math.sqrt(d_model) if embeddings_scaled(block, scale_embeddings) else 1.0
        self.tok = nn.Embedding(vocab_size, d_model)
        self.drop = nn.Dropout(dropout)
        kind = Block if block == "gpt" else LlamaBlock
        self.blocks = nn.ModuleList(kind(d_model, n_head, d_ff, dropout, norm_eps, attn_scale=attn_scale,
                                         qk_norm=normed[i], qk_weight=qk_norm_weight, sink=attn_sink,
                                         n_kv_head=n_kv_head, head_dim=head_dim, qkv_bias=qkv_bias,
                                         qk_eps=QK_NORM_EPS if block == "gpt" else norm_eps)
                                    for i in range(n_layer))
        self.ln_f = final_norm(block, d_model, norm_eps)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_head:
            self.head.weight = self.tok.weight  # tied input and output embeddings
        residual = ("proj.weight", "mlp.2.weight") if block == "gpt" else ()  # GPT-2's scaled maps into the residual
        for name, p in self.named_parameters():
            if name.startswith(("scheme.", "global_scheme.")) or name.endswith(".ssmax"):
                continue
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(residual) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for block in self.blocks if attn_sink else ():  # last: every other weight as without sinks
            nn.init.normal_(block.attn.sink, std=SINK_STD)

    @property
    def layer_schemes(self) -> list[PositionalScheme]:
        """Each layer's scheme instance: the shared one of its kind (local or global), or layer l's own."""
        parts = {"L": self._instances(self.scheme), "G": self._instances(self.global_scheme or self.scheme)}
        if self.global_scheme is None:
            return parts["L"]
        taken = {"L": iter(parts["L"]), "G": iter(parts["G"])}
        return [next(taken[kind]) for kind in self.kinds]

    def _instances(self, module) -> list[PositionalScheme]:
        """The instances of a scheme module, one per layer that uses it (a shared one repeated)."""
        users = len(self.blocks) if self.global_scheme is None else self.kinds.count("L" if module is self.scheme else "G")
        return list(module) if isinstance(module, nn.ModuleList) else [module] * users

    def scheme_parts(self) -> list[tuple[str, PositionalScheme]]:
        """Each scheme instance with its state-dict prefix: ``[("scheme.", scheme)]`` when shared,
        ``[("scheme.0.", layer 0's), …]`` per layer; then the global scheme's (``global_scheme.``), if any."""
        parts = []
        for prefix, module in (("scheme.", self.scheme), ("global_scheme.", self.global_scheme)):
            if isinstance(module, nn.ModuleList):
                parts += [(f"{prefix}{i}.", s) for i, s in enumerate(module)]
            elif module is not None:
                parts.append((prefix, module))
        return parts

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                last: int | None = None) -> torch.Tensor:
        """idx: (B, T) int64 token ids; pos: (T,) absolute positions, default 0…T−1 → logits (B, T, V) (``last``: of
        the last ``last`` positions only, (B, last, V), so that a probe scoring a few tokens keeps no (B, T, V)), or, given
        targets (B, T) int64, each target's NLL in nats (B, T) float32 (from float32 logits whatever autocast
        does; on CPU through ``head.HeadNLL``, without a (B·T, V) logits tensor; on CUDA so too, with chunk logits in
        autocast's dtype, where ``head.CHUNKED_HEAD_CUDA`` is set: ``head.head_dtype``)."""
        span = None  # max(pos) − min(pos) + 1, known without reading pos for the default positions
        if pos is None:
            pos, span = torch.arange(idx.shape[1], device=idx.device), idx.shape[1]
        layers = self.layer_schemes
        x = self.drop(layers[0].embed(self.tok(idx) * self.embed_scale, pos))  # (B, T, D)
        # once per pass, scheme instance and window (every layer's, or each layer's own): kernel, rotation tables, bias
        dropout = self.attn_dropout if self.training else 0.0  # of the attention probabilities
        sink = self.blocks[0].attn.sink is not None
        contexts = {}
        for s, window in zip(layers, self.windows):  # (a loop: torch.compile cannot resume a comprehension after a
            if (id(s), window) not in contexts:  # graph break)
                contexts[(id(s), window)] = dispatch.context(s, pos, self.n_head, x.dtype, dropout, span=span,
                                                              window=window, sink=sink, remap=self.remap)
        factor = None if self.attn_scale == "none" else temperature.factor(  # (T, 1)
            self.attn_scale, idx.shape[1], self.scale_length, self.scale_beta, idx.device)
        for block, scheme, window, scaled in zip(self.blocks, layers, self.windows, self.scaled):
            x = block(x, contexts[(id(scheme), window)], factor if scaled else None)
        x = self.ln_f(x)  # (B, T, D)
        if targets is None:
            return self.head(x if last is None else x[:, -last:])  # (B, T, V) or (B, last, V)
        amp = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
        mm_dtype = head.head_dtype(x.device, x.dtype, head.CHUNKED_HEAD_CUDA, amp)
        if mm_dtype is not None:
            rows = head.head_rows(x.device, self.head.weight.shape[0])
            need_grad = torch.is_grad_enabled() and (x.requires_grad or self.head.weight.requires_grad)
            nll = head.HeadNLL.apply(x.flatten(0, 1), self.head.weight, targets.flatten(), rows, need_grad,  # (B·T,)
                                mm_dtype)
        else:
            nll = nn.functional.cross_entropy(self.head(x).float().flatten(0, 1), targets.flatten(), reduction="none")
        return nll.view(targets.shape)  # (B, T)


def _windows(kinds: str, window: int | None, window_kind: str) -> list[Window | None]:
    """Each layer's window: ``Window(window, window_kind)`` for an L layer, None for a G layer or without a window.
    Raises ValueError for a window without an L layer, or one posbench.attention.windows.Window refuses."""
    if window is None:
        return [None] * len(kinds)
    if "L" not in kinds:
        raise ValueError(f"window={window!r} applies to the L layers, and layer_pattern {kinds} has none")
    w = Window(window, window_kind)
    return [w if kind == "L" else None for kind in kinds]


def _scheme_module(scheme, users: int, name: str, embed_ok: bool) -> nn.Module:
    """The module a scheme argument registers: the instance, or an ``nn.ModuleList`` of one instance per layer that
    uses it (``users``). Raises ValueError: a list of another length or of several classes; a scheme that embeds
    positions built per layer, or beside another scheme (``embed_ok`` False)."""
    per_layer = isinstance(scheme, (list, tuple))
    kinds = {type(s) for s in scheme} if per_layer else {type(scheme)}
    if per_layer and (len(scheme) != users or len(kinds) != 1):
        raise ValueError(f"{len(scheme)} schemes of {len(kinds)} classes for the {users} layers of {name}: give one "
                         "scheme, or one per layer of one class")
    embeds = type(scheme[0] if per_layer else scheme).embed is not PositionalScheme.embed
    if embeds and per_layer:
        raise ValueError(f"{type(scheme[0]).__name__} adds positions to the embeddings, once: it cannot "
                         "be built per layer")
    if embeds and not embed_ok:
        raise ValueError(f"{type(scheme[0] if per_layer else scheme).__name__} adds positions to the embeddings, once, "
                         "before the first layer: it cannot be the scheme of some layers only")
    return nn.ModuleList(scheme) if per_layer else scheme
