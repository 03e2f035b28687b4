"""The passkey needle: a marker, a key of k tokens and an end mark, in a corpus's tokenizer (Mohtashami & Jaggi 2023).

The same needle format serves the retrieval probe (posbench/evaluation/passkey.py: haystacks of evaluation text) and
training (``data.passkey_rate``: posbench/data/batches.py's ``insert``, fresh keys at distances within the window).

    needle = make_needle(tokenizer_path, train_tokens, " The pass key is", ".", key_length=4, key_vocab=10, keys="digits")
    key = needle.draw_key(np.random.default_rng(0))   # (k,) int64
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

KEYS = {"digits": 10, "frequent": 100, "reserved": 100}  # eval.passkey.keys → its default key vocabulary size


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


def make_needle(tokenizer_path, train_tokens: np.ndarray, marker: str, end: str, key_length: int, key_vocab: int,
                keys: str = "digits") -> Needle:
    """The needle format of a corpus's tokenizer, with the key vocabulary ``keys`` names:

    * ``digits``: the first ``key_vocab`` (≤ 10) digits, each one token, after a space appended to the marker, so a
      needle reads " The pass key is 7143." as in Mohtashami & Jaggi (2023, Appendix);
    * ``frequent``: the ``key_vocab`` most frequent whole-word tokens of the train split (a byte-level BPE token for
      a space then three or more letters, e.g. ``Ġthe``), words the haystack is full of;
    * ``reserved``: the first ``key_vocab`` token ids that never occur in the train split (stray bytes, unused merges).

    No key token is a token of the marker or the end mark, so keys are tokens the model can emit.

    Raises ValueError (``eval.passkey.<option>=<value>: …``): ``key_length`` < 1, an unknown ``keys``, a key
    vocabulary the tokenizer lacks (a digit it does not spell as one token, fewer than ``key_vocab`` whole words or
    absent tokens), or a marker or end mark that the tokenizer cannot encode and decode back (or that is empty)."""
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
    else:
        pool = [i for i in np.flatnonzero(counts == 0) if i not in taken]
        what = "tokens absent from the train split"
    if key_vocab < key_length or len(pool) < key_vocab:
        raise ValueError(f"eval.passkey.key_vocab={key_vocab}: the key vocabulary must hold at least key_length="
                         f"{key_length} tokens and at most the {len(pool)} {what}")
    return Needle(ids["marker"], ids["end"], tuple(int(i) for i in pool[:key_vocab]), key_length)


def key_fraction(tokens: np.ndarray, needle: Needle) -> float:
    """The fraction of ``tokens`` (a split, the haystack's source) that are key tokens of ``needle``: how often the
    haystack itself holds what the query asks for (≈ 0 for digits on Shakespeare, ≈ 0.2 for the 100 frequent words)."""
    tokens = np.asarray(tokens)
    return float(np.isin(tokens, np.asarray(needle.keys)).mean()) if len(tokens) else 0.0


def _whole_word(token: str | None) -> bool:
    return bool(token) and token.startswith("Ġ") and len(token) >= 4 and token[1:].isalpha() and token[1:].isascii()
