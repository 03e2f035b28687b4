"""The passkey needle: a marker, a key of k tokens and an end mark, in a corpus's tokenizer (Mohtashami & Jaggi 2023).

The same needle format serves the retrieval probe (posbench/evaluation/passkey.py: haystacks of evaluation text) and
training (``data.passkey_rate``: posbench/data/batches.py's ``insert``, fresh keys at distances within the window).

    needle = make_needle(tokenizer_path, train_tokens, " The pass key is", ".", key_length=4, key_vocab=10, keys="digits")
    key = needle.draw_key(np.random.default_rng(0))   # (k,) int64
    transfer_kind("digits", trained_keys(run_config))  # "frequent": the kind the probe's transfer control reads
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

KEYS = {"digits": 10, "frequent": 100, "reserved": 100, "half": None, "heldout": None}  # eval.passkey.keys → its
# default key vocabulary size (None: the whole half)
SPLIT_SEED = 0  # the split's seed: fixed, so every run on a tokenizer and train split has the same halves


def trained_keys(config: dict) -> str | None:
    """The key kind of a run's training needles (its recorded ``eval.passkey.keys`` where ``data.passkey_rate`` > 0),
    or None: a run that trained none, or a pretrained checkpoint's config."""
    if not (config.get("data") or {}).get("passkey_rate"):
        return None
    return config["eval"]["passkey"]["keys"]


def transfer_kind(probe: str, trained: str | None) -> str:
    """The key kind the passkey probe's transfer control reads (``eval.passkey.transfer`` left to its default): a kind
    the run never trained on as keys and not the probe's own ``probe``. ``trained``: the kind of the run's training
    needles (None: it trained none). A run that trained on ``half`` is read on ``heldout``; otherwise ``frequent``
    for a digit probe, else ``digits``, else ``frequent``, else ``reserved`` (the first neither trained nor probed)."""
    if trained == "half" and probe != "heldout":
        return "heldout"
    order = ("frequent", "digits", "reserved") if probe == "digits" else ("digits", "frequent", "reserved")
    return next(k for k in order if k not in (probe, trained))


@dataclass(frozen=True)
class Needle:
    """The probe's token format: ``marker`` and ``end`` (token ids), the key vocabulary ``keys`` (K,) and the key
    length k. A needle is marker + key + end (:attr:`needle_length` tokens), a query marker + key."""

    marker: tuple[int, ...]
    end: tuple[int, ...]
    keys: tuple[int, ...]
    k: int

    @property
    def needle_length(self) -> int:
        return len(self.marker) + self.k + len(self.end)

    @property
    def query_length(self) -> int:
        return len(self.marker) + self.k

    def draw_key(self, rng: np.random.Generator) -> np.ndarray:
        """k token ids drawn uniformly, with replacement, from the key vocabulary: (k,) int64."""
        return np.asarray(self.keys, dtype=np.int64)[rng.integers(0, len(self.keys), self.k)]

    def draw_pair(self, rng: np.random.Generator) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A trial's key and its control's other key, drawn in that order by :meth:`draw_key`, the other redrawn
        until it differs: two (k,) tuples of token ids."""
        key, other = self.draw_key(rng), self.draw_key(rng)
        while np.array_equal(other, key):
            other = self.draw_key(rng)
        return tuple(key.tolist()), tuple(other.tolist())


def make_needle(tokenizer_path, train_tokens: np.ndarray, marker: str, end: str, key_length: int, key_vocab: int,
                keys: str = "digits") -> Needle:
    """The needle format of a corpus's tokenizer, with the key vocabulary ``keys`` names:

    * ``digits``: the first ``key_vocab`` (≤ 10) digits, each one token, after a space appended to the marker, so a
      needle reads " The pass key is 7143." as in Mohtashami & Jaggi (2023, Appendix);
    * ``frequent``: the ``key_vocab`` most frequent whole-word tokens of the train split (a byte-level BPE token for
      a space then three or more letters, e.g. ``Ġthe``), words the haystack is full of;
    * ``reserved``: the first ``key_vocab`` token ids that never occur in the train split (stray bytes, unused merges);
    * ``half``, ``heldout``: the two halves of :func:`key_halves`' split (``key_vocab`` None: the whole half, else its
      first ``key_vocab`` in the split's shuffled order), random tokens of every kind the corpus holds.

    No key token is a token of the marker or the end mark, so keys are tokens the model can emit.

    Raises ValueError (``eval.passkey.<option>=<value>: …``): ``key_length`` < 1, an unknown ``keys``, a key
    vocabulary the tokenizer lacks (a digit it does not spell as one token, fewer than ``key_vocab`` whole words,
    absent tokens or tokens of the half), or a marker or end mark that the tokenizer cannot encode and decode back (or
    that is empty)."""
    if key_length < 1:
        raise ValueError(f"eval.passkey.key_length={key_length}: a key needs at least one token")
    if keys not in KEYS:
        raise ValueError(f"eval.passkey.keys={keys!r} is unknown; choose one of: {', '.join(KEYS)}")
    tok = Tokenizer.from_file(str(tokenizer_path))
    ids = {}
    for name, text in (("marker", marker), ("end", end)):
        enc = tok.encode(text).ids
        if not text or tok.decode(enc) != text:
            raise ValueError(f"eval.passkey.{name}={text!r}: the run's tokenizer cannot encode it (it decodes back as "
                             f"{tok.decode(enc)!r}); choose text in the corpus's alphabet")
        ids[name] = tuple(enc)
    taken = set(ids["marker"]) | set(ids["end"])
    if keys == "digits":
        ids["marker"] = tuple(tok.encode(marker + " ").ids)
        vocab = [tok.token_to_id(str(d)) for d in range(min(key_vocab, 10))]
        digit = {str(d): tok.token_to_id(str(d)) for d in range(10)}
        pairs = [f"{a}{b}" for a in range(10) for b in range(10)]  # (a merge of longer digit strings needs one of these)
        spelt = all(tok.encode(marker + " " + text).ids == [*ids["marker"], *(digit[c] for c in text)]
                    for text in [*digit, *pairs])
        if None in vocab or not spelt or taken & set(vocab):
            raise ValueError("eval.passkey.keys=digits: the run's tokenizer does not spell each digit as a token of its "
                             "own after the marker; choose eval.passkey.keys=frequent or reserved")
        if key_vocab > len(vocab):
            raise ValueError(f"eval.passkey.key_vocab={key_vocab}: a digit key draws from at most the 10 digits")
        return Needle(ids["marker"], ids["end"], tuple(int(i) for i in vocab), key_length)
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=tok.get_vocab_size())
    if keys == "frequent":
        pool = [i for i in np.argsort(-counts, kind="stable") if counts[i] > 0 and i not in taken
                and _whole_word(tok.id_to_token(int(i)))]
        what = "whole-word tokens of the tokenizer"
    elif keys == "reserved":
        pool = [i for i in np.flatnonzero(counts == 0) if i not in taken]
        what = "tokens absent from the train split"
    else:
        pool = list(key_halves(tok, counts, taken)[keys == "heldout"])
        what = f"tokens of the {keys} half"
        key_vocab = len(pool) if key_vocab is None else key_vocab
    if key_vocab < key_length or len(pool) < key_vocab:
        raise ValueError(f"eval.passkey.key_vocab={key_vocab}: the key vocabulary must hold at least key_length="
                         f"{key_length} tokens and at most the {len(pool)} {what}")
    return Needle(ids["marker"], ids["end"], tuple(int(i) for i in pool[:key_vocab]), key_length)


def key_halves(tok: Tokenizer, counts: np.ndarray, taken: set[int]) -> tuple[np.ndarray, np.ndarray]:
    """The split behind ``half`` and ``heldout`` keys: every token id that occurs in the train split (``counts``: its
    (V,) token counts) but the tokenizer's special tokens and ``taken`` (the marker's and end mark's), shuffled by
    ``default_rng(SPLIT_SEED)``; ``half`` is the first ⌈n/2⌉ of the shuffled ids, ``heldout`` the rest, each (n/2,)
    int64 in shuffled order. A pure function of the tokenizer and the train split, so training and every later probe
    draw the same halves; the records name them by :func:`key_digest`."""
    special = set(tok.get_added_tokens_decoder())
    eligible = np.asarray([i for i in np.flatnonzero(counts > 0) if int(i) not in taken and int(i) not in special],
                          dtype=np.int64)
    shuffled = np.random.default_rng(SPLIT_SEED).permutation(eligible)
    cut = (len(shuffled) + 1) // 2
    return shuffled[:cut], shuffled[cut:]


def key_digest(needle: Needle) -> str:
    """The first 16 hex digits of the sha256 of a needle's key vocabulary (sorted ids, int64 little-endian): what a
    record says of the keys it drew, so two probes' vocabularies can be told apart."""
    return hashlib.sha256(np.sort(np.asarray(needle.keys, dtype="<i8")).tobytes()).hexdigest()[:16]


def key_fraction(tokens: np.ndarray, needle: Needle) -> float:
    """The fraction of ``tokens`` (a split, the haystack's source) that are key tokens of ``needle``: how often the
    haystack itself holds what the query asks for (≈ 0 for digits on Shakespeare, ≈ 0.2 for the 100 frequent words)."""
    tokens = np.asarray(tokens)
    return float(np.isin(tokens, np.asarray(needle.keys)).mean()) if len(tokens) else 0.0


def _whole_word(token: str | None) -> bool:
    return bool(token) and token.startswith("Ġ") and len(token) >= 4 and token[1:].isalpha() and token[1:].isascii()
