"""The positional-scheme interface, its typed ``Config``, and how a scheme registers itself.

Every scheme is a :class:`PositionalScheme` that overrides one kind of hook (docs/design.md §3):

* ``embed(x, pos)``                      additive absolute positions (sinusoidal, learned)
* ``rotation(pos, dtype)`` and
  ``rotate(q, k, rotation)``             rotary positions applied to queries and keys (RoPE, xPos), with
                                         ``rotary = True``: the tables are computed once per forward pass, then
                                         applied in every layer (queries and keys at different positions: tables
                                         of one ``centre``, the keys' given as ``key_rotation``)
* ``score_mod(score, h, q_pos, k_pos)``  an additive attention bias (ALiBi, T5, KERPLE, Sandwich, FIRE), with
                                         ``has_bias = True``
* ``contextual_bias(q, scores)``         a bias computed from the queries and their scores (CoPE), with
                                         ``contextual = True``

Positions are explicit absolute token indices, so an evaluator may shift or scale them. The model never probes a
hook to learn what a scheme does: the class attributes ``has_bias``, ``key_only_bias`` and ``contextual`` say it,
and posbench/attention/dispatch.py picks the attention kernel from them. A scheme's hyperparameters are a nested dataclass
``Config``: ``resolve(seq_len, longest)`` fills its derived defaults (``fill``) and checks its values
(``check``), once, where the run's config is made; the scheme's constructor takes the config as it is given.

A family file in posbench/schemes/ registers each of its schemes with ``@register("name")``; the package
collects them into ``posbench.schemes.SCHEMES``. This module imports nothing of posbench.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

REGISTERED: dict[str, type] = {}  # name → scheme class, as the family modules register them (any order)


def register(name: str):
    """Class decorator: register a scheme class under ``name`` (``scheme=<name>`` on the command line).

    Raises ValueError when another class already has that name."""

    def add(cls: type) -> type:
        if REGISTERED.setdefault(name, cls) is not cls:
            raise ValueError(f"two schemes are registered as {name!r}: {REGISTERED[name].__name__} and {cls.__name__}")
        return cls

    return add


@register("nope")
class PositionalScheme(nn.Module):
    """No positional information (NoPE): the causal mask is the only source of order. Every hook is the
    identity. The base of every scheme.

    All schemes share one constructor signature, ``(d_model, n_head, config=None, head_dim=None)``, so the registry can
    build any of them; ``config`` is an instance of the scheme's own ``Config`` (None: its defaults), kept as
    ``self.config`` and trusted as given: it is checked where it is made (``Config.resolve`` or ``check``).

    Class attributes (what the attention kernel is chosen from; posbench/attention/dispatch.py):
        has_bias: ``score_mod`` adds a bias to the attention scores. False: causal attention is all there
            is, and the fastest causal kernel runs.
        contextual: ``contextual_bias`` adds a bias that depends on the content (the queries and their scores), not
            on positions alone, so it cannot be a pointwise ``score_mod``: the ``contextual`` kernel runs, which
            materialises every (query, key) score, a block of queries at a time. False here.
        key_only_bias: the bias has the form b(h, i, j) = g(h, j) − g(h, i) for every query position i and key
            position j (any bias linear in i − j, such as ALiBi's, has it). Then, for a reference position c,
            b(h, i, j) = b(h, c, j) + (a term that depends on i alone), and softmax ignores a term constant
            across a query's row, so the key-only bias ``score_mod(0, h, c, k_pos)`` gives the same
            attention; the kernel may fold it into one extra head dimension of q and k.
        distance_table: the bias is a function of the head and the distance i − j alone (T5, KERPLE, Sandwich), and
            costlier than a table lookup: the kernels evaluate it once per forward pass on every distance the window
            holds, as an (H, N) table (:meth:`pair_bias` of distances 0…N−1 against key position 0), and index that table
            with i − j, inside FlexAttention as in the dense kernel. Flex's backward then adds each score's gradient
            into the table's H·N entries, where indexing the parameters themselves in ``score_mod`` would contend for
            a few addresses or (an MLP's weights indexed once per hidden unit) not compile at all. False here, and for
            ALiBi, whose bias is one multiply.
        translation_invariant: the bias is a function of the head and the distance i − j alone (ALiBi; every
            ``distance_table`` scheme is too): CPU evaluation runs it through the ``banded`` kernel. False here.
        invariant_below_limit: the bias is a function of the head and i − j alone for every query position up to
            :meth:`invariant_limit`, a learned value (FIRE: its threshold L_thr, below which every query's normaliser
            is the same): CPU evaluation of a window whose positions all lie in that range builds the per-distance
            table once per forward pass and runs it as a ``distance_table`` bias (the ``banded`` kernel). False here.
        far_constant: a ``distance_table`` bias that is the same for every distance from :attr:`far_distance` on
            (T5 past ``max_distance``): CPU evaluation then attends to those keys without a bias and adds the
            head's constant to their log-sum-exp (the ``banded`` kernel). False here.
        rotary: ``rotation`` and ``rotate`` turn queries and keys by their positions (RoPE, p-RoPE, xPos): an
            evaluation that remaps positions per (query, key) pair (posbench/attention/remap.py) turns them once per region.
            False here.
        weight_decay: AdamW decays this scheme's parameters (a decision per scheme, not by tensor rank).
        fine_tune_options: the options a run started from this scheme's trained weights (``init_from``,
            posbench/training/lineage.py) may set to other values than the parent's: none here; RoPE's context-extension
            options; the learned table's size. Any other difference is refused.

    Args:
        d_model: model width D.
        n_head: attention heads H (of the queries: under grouped-query attention each key head serves several).
        config: the scheme's hyperparameters, a ``self.Config``; None gives the defaults.
        head_dim: Dh, the width of a head (``self.head_dim``); None: D / H (Qwen 3's heads are wider).
    Raises:
        ValueError: ``head_dim`` is None and H does not divide D, or ``head_dim`` is below 1.
    """

    has_bias: bool = False
    key_only_bias: bool = False
    distance_table: bool = False
    translation_invariant: bool = False
    invariant_below_limit: bool = False
    far_constant: bool = False
    contextual: bool = False
    rotary: bool = False
    weight_decay: bool = False
    fine_tune_options: tuple[str, ...] = ()  # options a run started from this scheme's weights may change (init_from)

    @dataclasses.dataclass
    class Config:
        """The scheme's hyperparameters: none. A scheme with options declares its own ``@dataclass class
        Config(PositionalScheme.Config)`` with typed fields (their types are the configuration's types),
        defaults and a docstring, overriding :meth:`fill` for derived defaults and :meth:`check` for values."""

        def resolve(self, seq_len: int, longest: int) -> None:
            """Fill derived defaults in place from the train length ``seq_len`` (L) and check every value against
            ``longest``, the longest length the model will see (L or the longest evaluation length).

            Raises ValueError whose message starts with ``<field>=<value>`` and says what is allowed."""
            self.fill(seq_len)
            self.check(longest)

        def fill(self, seq_len: int) -> None:
            """Set the options left None that default to something derived from the train length L: none here."""

        def check(self, longest: int | None = None) -> None:
            """Raise ValueError (``<field>=<value>: what is allowed``) for a bad value; with ``longest``, also for
            values that cannot serve a window of that many positions. An option still None (to be filled from L)
            passes. Nothing to check here."""

        def label(self) -> str:
            """What the scheme's name alone does not say about this variant, appended to it in every label
            (results, eval file names, wandb, report rows, plots): "" here; RoPE's ``+yarn×16``."""
            return ""

    def __init__(self, d_model: int, n_head: int, config: Config | None = None, head_dim: int | None = None):
        super().__init__()
        if head_dim is None and d_model % n_head or head_dim is not None and head_dim < 1:
            raise ValueError(f"head_dim={head_dim!r} with d_model={d_model}, n_head={n_head}: give a head width of at "
                             "least 1, or none where n_head divides d_model")
        self.d_model, self.n_head = d_model, n_head
        self.head_dim = d_model // n_head if head_dim is None else head_dim
        self.config = self.Config() if config is None else config

    @classmethod
    def reads_positions(cls) -> bool:
        """Whether the scheme uses positions at all: it overrides ``embed``, ``rotation`` or ``score_mod`` (NoPE does
        not, nor does CoPE, whose positions are counted from the content, so randomized training positions,
        ``train.random_positions``, mean nothing to them)."""
        return any(getattr(cls, hook) is not getattr(PositionalScheme, hook) for hook in ("embed", "rotation", "score_mod"))

    @classmethod
    def options(cls) -> list[str]:
        """The names of the scheme's options: the fields of its ``Config``, in order."""
        return [f.name for f in dataclasses.fields(cls.Config)]

    @classmethod
    def make_config(cls, **options) -> Config:
        """``cls.Config(**options)``, neither filled nor checked. Raises ValueError for an option the Config lacks,
        starting ``<option>=<value>`` and listing the scheme's options."""
        allowed = cls.options()
        for key, value in options.items():
            if key not in allowed:
                raise ValueError(f"{key}={value!r}: the {cls.__name__} scheme has no option {key!r}; its options: "
                                 f"{', '.join(allowed) or 'none'}")
        return cls.Config(**options)

    def adopt(self, trained: dict[str, torch.Tensor], rows: str, trained_length: int, new_length: int) -> None:
        """Take a parent's trained scheme tensors (its ``state_dict``, keys without ``scheme.``) into this scheme,
        built with the new run's options: a run started from another run's weights (posbench/training/lineage.py). Here they
        must fit exactly; a scheme whose tensors may change shape (the learned table) overrides this.

        Args:
            trained: the parent scheme's tensors.
            rows: how new rows of a grown table are made (``init_rows``: ``scheme`` or ``interpolate``); only a
                scheme with a position table takes ``interpolate``.
            trained_length, new_length: the parent's train length L and the new run's.

        Raises ValueError: a tensor missing, extra or of another shape (the message names it and both shapes), or
            ``rows=interpolate`` for a scheme without a position table."""
        if rows != "scheme":
            raise ValueError(f"init_rows={rows}: the {type(self).__name__} scheme has no position table to interpolate")
        own = self.state_dict()
        for key in sorted(set(own) | set(trained)):
            mine, theirs = own.get(key), trained.get(key)
            if mine is None or theirs is None or mine.shape != theirs.shape:
                raise ValueError(f"the parent's scheme.{key} has shape {_shape(theirs)} and this run's {_shape(mine)}")
        self.load_state_dict(trained)

    def embed(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: (B, T, D) token embeddings, pos: (T,) int64 → (B, T, D)."""
        return x

    def rotation(self, pos: torch.Tensor, dtype: torch.dtype, centre: float | None = None) -> object:
        """pos: (T,) int64 (or float64: remapped positions, posbench/attention/remap.py) → whatever :meth:`rotate` needs for
        these positions (RoPE: cos and sin tables), computed once per forward pass and shared by every layer; None
        for a scheme that does not rotate. ``dtype`` is the activations' dtype (float32, or float64 in a reference
        computation). ``centre``: where a scheme that scales by position (xPos) centres its scales, None: the middle
        of ``pos``; tables for queries and keys at different positions are made with one centre."""
        return None

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rotation: object,
               key_rotation: object = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: (B, H, T, Dh), rotation: what :meth:`rotation` returned for their positions (``key_rotation``: for
        the keys' positions where they differ from the queries', None: the same) → rotated (q, k) of the same
        shapes."""
        return q, k

    def score_mod(self, score: torch.Tensor, h: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """The attention score of query position ``q_pos`` and key position ``k_pos`` in head ``h``, given the
        score q·k/√Dh before positions: score + bias(h, q_pos, k_pos). Identity here.

        One pointwise description serves every kernel: FlexAttention calls it with 0-d tensors (int32 indices,
        the score in the kernel's dtype); the dense kernel with broadcastable tensors, e.g. score a 0-d zero,
        h (H, 1, 1), q_pos (1, Tq, 1) and k_pos (1, 1, Tk) int64, to build a bias block (H, Tq, Tk). It must
        therefore be additive in ``score`` (the dense kernel evaluates it at score 0 and adds the result) and use
        only broadcasting tensor operations. The causal mask is the attention's, so the bias need not mask.
        A scheme that overrides it sets ``has_bias = True``. Learned parameters used here get gradients.
        """
        return score

    def pair_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The bias of queries at positions ``q_pos`` (Tq,) against keys at ``k_pos`` (Tk,), both int64 →
        (H, Tq, Tk), future keys included (the attention masks them), computed as the scores are: at least in
        ``dtype`` (float64 in a reference computation; the caller casts).
        Here :meth:`score_mod` at score 0 on broadcast positions; a scheme with a faster vectorised form of the same
        bias (FIRE's MLP as one matmul) overrides it. The dense kernel builds its mask blocks from it, and the
        per-distance table of a ``distance_table`` scheme is its row against key position 0."""
        heads = torch.arange(self.n_head, device=q_pos.device)[:, None, None]  # (H, 1, 1)
        zero = torch.zeros((), dtype=dtype, device=q_pos.device)
        bias = self.score_mod(zero, heads, q_pos[None, :, None], k_pos[None, None, :])  # (H, Tq, Tk) or broadcastable
        return bias.expand(self.n_head, q_pos.numel(), k_pos.numel())

    def invariant_limit(self) -> float:
        """The last query position up to which the bias is a function of the head and i − j alone, read where
        ``invariant_below_limit`` is set (a host read of learned parameters); −inf here."""
        return -math.inf

    @classmethod
    def dense_rows(cls, grad: bool, device: torch.device) -> int | None:
        """Query rows per block in which :meth:`pair_bias` computes a causal layer's bias best when the ``dense``
        kernel runs it (posbench/attention/builders.py), or None: as many rows as the kernel's budget allows, every
        block's mask built once per forward pass. A scheme that sets it also evaluates ``dense`` where it holds
        (posbench/attention/choice.py); FIRE's fold: 64 rows on CPU without gradients."""
        return None

    def contextual_bias(self, q: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The bias a contextual scheme adds to the scores of one block of queries, before the softmax: zeros here.

        q: (B, H, Q, Dh) the block's queries (rotated where the scheme rotates); scores: (B, H, Q, K) their q·k/√Dh
        against keys 0…K−1 of the window, −inf where the key comes after the query (by index), in float32 or float64
        (a 16-bit q's scores are widened) → (B, H, Q, K) bias, finite where the score is. The ``contextual`` kernel
        (posbench/attention/dispatch.py) calls it, once per block and layer, with ``contextual = True``; it owns the blocks,
        the mask, the softmax, dropout and the product with v. Gradients flow to q, to the scores (so to the keys)
        and to the scheme's parameters."""
        return torch.zeros_like(scores)


def _shape(t: torch.Tensor | None) -> str:
    return "(none)" if t is None else str(tuple(t.shape))


# ---- checks of an option's value, shared by the Configs ----------------------------------------------------


def is_int(value) -> bool:
    """``value`` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """``value`` is a finite int or float and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_per_layer(per_layer, scheme: str) -> None:
    """Raise ValueError (``per_layer=<value>: ...``) unless ``per_layer``, a scheme's one-instance-per-layer option
    (FIRE's, CoPE's), is a bool."""
    if not isinstance(per_layer, bool):
        raise ValueError(f"per_layer={per_layer!r}: true (one {scheme} per layer) or false (one shared)")


def check_base(base) -> None:
    """Raise ValueError (``base=<value>: ...``) unless ``base``, a wavelength base, is a number > 0."""
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
        raise ValueError(f"base={base!r}: the wavelength base must be a number > 0")
