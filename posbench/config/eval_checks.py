"""The value checks of a config's evaluation: ``eval.*`` and its probes (:func:`eval_values`), and a training-free
remap (:func:`remap_values`), run by ``posbench.config.schema.finalize`` after the sections of posbench/config/checks.py.

    eval_values(cfg.eval, L, needles, training); remap_values(cfg.eval, cfg.model, cfg.scheme, L, training)
    key_kinds(cfg.eval.passkey, trained, training=False)  # a re-evaluation's, against its run's training needles

Each raises ``ConfigError``, one line naming the value and what is allowed; :func:`eval_values` fills the derived
lengths and strides in place, :func:`remap_values` the method's default parameters.
"""

from __future__ import annotations

from omegaconf import DictConfig

from posbench.attention import remap
from posbench.config.checks import ConfigError, inert, longest_length, positive
from posbench.data.needles import KEYS
from posbench.evaluation import context, passkey
from posbench.schemes import SCHEMES

NEEDLE_FORMAT = ("keys", "key_vocab", "key_length", "marker", "end")  # eval.passkey's, also the training needles'


def eval_values(e: DictConfig, seq_len: int, needles: bool = False, training: bool = False) -> None:
    """Fill ``eval.lengths`` (None → L·2^k, k = 0…4), ``eval.passkey.lengths`` (None → ``eval.lengths``) and
    ``eval.context.stride`` (None → L // 8), and check the evaluation settings (the probes' options by their own
    checks: posbench/evaluation/passkey.py, posbench/evaluation/context.py); a probe's options set without the probe
    are refused, except
    the needle format (:data:`NEEDLE_FORMAT`) when ``needles``: a training run's needles take it too. When
    ``training``, the probe's key kinds are checked against the needles the run trains (:func:`key_kinds`; a
    re-evaluation checks them against its run's: posbench/jobs/eval_job.py)."""
    if e.max_tokens is not None:
        positive("eval.max_tokens", e.max_tokens)
    positive("eval.batch_tokens", e.batch_tokens)
    if isinstance(e.probe_every, bool) or not isinstance(e.probe_every, int) or e.probe_every < 0:
        raise ConfigError(f"eval.probe_every={e.probe_every!r} is not allowed: give the training steps between probes "
                          "(> 0), or 0 for none")
    if e.probe_every and "passkey" not in e.probes:
        raise ConfigError(f"eval.probe_every={e.probe_every} probes retrieval during training: add "
                          "'eval.probes=[passkey]', or drop eval.probe_every")
    given = {probe: dict(e[probe]) for probe in ("passkey", "context")}  # before the fills below
    if e.lengths is None:
        e.lengths = [seq_len * 2**k for k in range(5)]
    if len(e.lengths) == 0:
        raise ConfigError("eval.lengths=[] is empty: give at least one evaluation length >= 2")
    for n in e.lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ConfigError(f"evaluation length {n!r} in eval.lengths is not allowed: each must be an integer >= 2")
    if list(e.lengths) != sorted(set(e.lengths)):
        raise ConfigError(f"eval.lengths={list(e.lengths)} is not allowed: give increasing lengths without repeats, "
                          f"e.g. [{','.join(map(str, sorted(set(e.lengths))))}] (tables and ratios read them in order)")
    if e.passkey.lengths is None:
        e.passkey.lengths = list(e.lengths)
    try:
        passkey.check(e.passkey)
        context.check(e.context, seq_len, list(e.lengths) if "context" in e.probes else None)  # fills the stride
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if training:
        key_kinds(e.passkey, e.passkey["keys"] if needles else None, True)
    filled = {("passkey", "lengths"): list(e.lengths), ("passkey", "key_vocab"): KEYS.get(e.passkey["keys"]),
              ("context", "stride"): max(1, seq_len // 8)}  # what the fills above give: a finalized config holds them
    for probe, values in given.items():  # a probe's valid options without the probe (the needle format: training's too)
        values = {k: v for k, v in values.items() if not (needles and probe == "passkey" and k in NEEDLE_FORMAT)
                  and not (v is not None and v == filled.get((probe, k)))}
        inert(values, {"passkey": passkey.Config, "context": context.Config}[probe](), f"eval.{probe}.",
              probe in e.probes, f"its probe: add 'eval.probes=[{probe}]'")
    if e.protocol != "sliding" and e.stride is not None:
        raise ConfigError(f"eval.stride={e.stride} applies to eval.protocol=sliding only, and eval.protocol="
                          f"{e.protocol}: drop eval.stride, or add eval.protocol=sliding")
    if e.protocol == "sliding":
        if e.stride is None:
            raise ConfigError("eval.protocol=sliding needs eval.stride (1 <= stride <= the evaluation length)")
        if e.stride < 1 or e.stride > min(e.lengths):
            raise ConfigError(f"eval.stride={e.stride} is not allowed: it must be between 1 and the smallest "
                              f"evaluation length {min(e.lengths)}")


def key_kinds(p: DictConfig, trained: str | None, training: bool) -> None:
    """Refuse a passkey probe of the ``heldout`` half (``eval.passkey.keys`` or ``.transfer``) on a run whose training
    keys did not leave it out: ``trained``, the kind of the run's training needles (None: it trained none), must be
    ``half``. ``training``: the run is being trained now, drawing its needles' keys from ``eval.passkey.keys``."""
    for key in ("keys", "transfer"):
        if p[key] != "heldout" or trained == "half":
            continue
        if training and trained == "heldout":
            raise ConfigError("eval.passkey.keys=heldout: a training run draws its needles' keys from eval.passkey.keys; "
                              "train on eval.passkey.keys=half, and its probe reads the held-out half as its transfer "
                              "control")
        raise ConfigError(f"eval.passkey.{key}=heldout probes the half of the tokens a run's training keys left out, and "
                          + (f"this run {'trains' if training else 'trained'} no needles" if trained is None
                             else f"this run's keys were {trained}")
                          + ": it needs a run trained with data.passkey_rate > 0 and eval.passkey.keys=half")


def remap_values(e: DictConfig, m: DictConfig, scheme: DictConfig, seq_len: int, training: bool) -> None:
    """``eval.remap`` and its ``eval.remap_options`` (filled with the method's defaults for L = ``seq_len`` and the
    longest window scored, probes included, and checked by posbench/attention/remap.py): only in a re-evaluation
    (``posbench eval``), on a model without windows whose schemes (``scheme``, and a hybrid's global one) do not take
    their positions from the content (CoPE), do not scale by the window's length (``dynamic_ntk``: a region's
    remapped positions would pick other frequencies than the window's), and, for a method that only remaps distances
    (all but streaming and lm_infinite, which also hide keys), read a position per (query, key) pair (rotary or bias
    schemes: for NoPE, sinusoidal and learned it would change nothing); Leaky ReRoPE's fractional distances not for
    T5's buckets; options without a method refused."""
    method = e.remap
    if method != "none":
        if training:
            raise ConfigError(f"eval.remap={method} applies to a trained run: posbench eval run=<run folder> "
                              f"eval.remap={method}")
        if m.window is not None:
            raise ConfigError(f"eval.remap={method} and model.window={m.window}: a remap runs on models without windows")
        g = m.get("global_scheme")
        sections = [scheme, *([g if not isinstance(g, str) else {"name": g}] if g is not None else [])]
        for section in sections:
            name, cls = section.get("name"), SCHEMES[section.get("name")]
            if cls.contextual:
                raise ConfigError(f"eval.remap={method} remaps positions per (query, key) pair, and scheme={name} "
                                  "computes its positions from the content: choose another scheme's run")
            if section.get("scaling") == "dynamic_ntk":
                raise ConfigError(f"eval.remap={method} and scheme.scaling=dynamic_ntk: dynamic NTK picks its frequencies "
                                  "from the positions it is given, which a remap changes per region; give another scaling")
            if method == "leaky_rerope" and name == "t5":
                raise ConfigError("eval.remap=leaky_rerope reads fractional distances past its window, and scheme=t5's "
                                  "buckets take whole ones: choose eval.remap=rerope for a T5 run")
        if method not in ("streaming", "lm_infinite") and not any(
                SCHEMES[x.get("name")].rotary or SCHEMES[x.get("name")].has_bias for x in sections):
            raise ConfigError(f"eval.remap={method} changes only the distances a scheme reads per (query, key) pair, and "
                              f"scheme={scheme.name} reads none: it would change nothing; streaming and lm_infinite "
                              "also hide keys")
    try:
        remap.check(method, e.remap_options, seq_len, longest_length(e))
    except ValueError as err:
        raise ConfigError(str(err)) from None
