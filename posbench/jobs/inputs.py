"""What a job reads before it runs, shared by ``posbench train`` and ``posbench eval`` jobs: the corpus of its config,
prepared into its cache with its splits checked against the job's lengths, and the passkey needle in the corpus's
tokenizer when the job trains or probes with needles.

    corpus = prepare_data(cfg)        # raises DataError or ConfigError
    needle = needle_of(cfg, corpus)   # a needles.Needle, or None
    kind, control = transfer_of(cfg, corpus, needles.trained_keys(run_config))   # the probe's transfer control
"""

from __future__ import annotations

from omegaconf import DictConfig

from posbench.config.checks import ConfigError
from posbench.config.schema import to_dict
from posbench.data import cache, needles
from posbench.evaluation import passkey
from posbench.evaluation.perplexity import span
from posbench.model import pretrained


def needle_of(cfg: DictConfig, corpus: cache.Corpus) -> needles.Needle | None:
    """The passkey needle of ``cfg.eval.passkey`` in the corpus's tokenizer when the job trains or probes with it,
    else None. Raises ConfigError: options the tokenizer cannot serve (``posbench.data.needles.make_needle``), probe
    lengths too short for a needle and a query, or, with ``data.passkey_rate`` > 0, training windows too short for
    ``data.passkey_pairs`` of them (the message names the window length they need)."""
    p, d = cfg.eval.passkey, cfg.data
    probing = "passkey" in cfg.eval.probes
    if not (d.get("passkey_rate") or probing):
        return None
    try:
        needle = needles.make_needle(corpus.tokenizer_path, corpus.tokens["train"], p.marker, p.end, p.key_length,
                                     p.key_vocab, p["keys"])
        if probing:
            passkey.trials(len(corpus.tokens[cfg.eval.split]), needle, list(p.lengths), list(p.depths), 1, p.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    pairs, width, pair = d.get("passkey_pairs", 1), cfg.train.seq_len + 1, needle.needle_length + needle.query_length
    if d.get("passkey_rate") and pairs * pair > width:  # (passkey.insert would leave every window without needles)
        fix = "raise train.seq_len" + (" or lower data.passkey_pairs" if pairs > 1 else ", or drop data.passkey_rate")
        raise ConfigError(f"data.passkey_rate={d.passkey_rate}: data.passkey_pairs={pairs} needle + query pairs take "
                          f"{pairs} × {pair} tokens, more than a training window of train.seq_len + 1 = {width}; "
                          f"needles need a window of at least {pairs * pair} tokens (train.seq_len >= "
                          f"{pairs * pair - 1}): {fix}")
    return needle


def transfer_of(cfg: DictConfig, corpus: cache.Corpus, trained: str | None) -> tuple[str, needles.Needle | None]:
    """(the transfer control's key kind, its needle) of a passkey probe (``eval.passkey.transfer``; unset: the kind
    ``needles.transfer_kind`` picks from the probe's and the ``trained`` one), ``("none", None)`` without one or
    without the probe. Its needle has the probe's key length, marker and end mark, and its kind's default key
    vocabulary. Raises ConfigError: a kind the tokenizer cannot serve (the message names ``eval.passkey.transfer``)."""
    p = cfg.eval.passkey
    if "passkey" not in cfg.eval.probes or p.transfer == "none":
        return "none", None
    kind = p.transfer or needles.transfer_kind(p["keys"], trained)
    try:
        return kind, needles.make_needle(corpus.tokenizer_path, corpus.tokens["train"], p.marker, p.end, p.key_length,
                                         needles.KEYS[kind], kind)
    except ValueError as e:
        raise ConfigError(f"eval.passkey.transfer={kind}: {e}") from None


def prepare_data(cfg: DictConfig) -> cache.Corpus:
    """The corpus of ``cfg.data``, prepared into its cache (or read from it), with its splits checked; tokenised with
    the tokenizer of the pretrained checkpoint ``data.tokenizer`` names (posbench/model/pretrained.py) where it names
    one, else with its own BPE.

    Raises:
        posbench.data.cache.DataError: unusable data.
        ConfigError: the evaluation split is shorter than the longest evaluation length (the message
            gives its token count), the train split is shorter than L + 2, or ``data.tokenizer`` names no checkpoint
            with a tokenizer.
    """
    t, e, data = cfg.train, cfg.eval, to_dict(cfg.data)
    source = data.pop("tokenizer")
    try:
        tokenizer = pretrained.tokenizer(source) if source else None
    except pretrained.PretrainedError as err:
        raise ConfigError(str(err).replace(f"pretrained={source}", f"data.tokenizer={source}", 1)) from None
    corpus = cache.prepare(**data, tokenizer=tokenizer)
    try:
        span(len(corpus.tokens[e.split]), list(e.lengths), e.max_tokens)
    except ValueError as err:
        raise ConfigError(str(err).replace("evaluation split", f"{e.split} split")) from None
    if len(corpus.tokens["train"]) <= t.seq_len + 1:
        raise ConfigError(f"the train split has {len(corpus.tokens['train'])} tokens, too few for train.seq_len={t.seq_len}")
    return corpus
