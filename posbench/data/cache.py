"""Corpus → byte-level BPE tokenizer → token-id memmaps, cached.

``prepare(...)`` returns a :class:`Corpus`: the trained tokenizer and one memmap of token ids per split
(train / validation / test). Every corpus is loaded through ``datasets``; the tokenizer is a byte-level
BPE trained with ``tokenizers`` on the train split only. The result lives in ``<cache_dir>/<name>-<key>/``
where ``key`` hashes the corpus identity (the files' bytes and split assignment; or the Hub name and config,
or the local copy's path and content fingerprint), the tokenizer settings and the budgets, so a second run
with the same data reuses it (and a changed file makes a new one).

The corpora themselves (shakespeare, text, wikitext103, wikitext2, pg19) are in ``posbench.data.corpora``.

Run through ``posbench train`` (the first run prepares the data; later runs reuse the cache).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Optional

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from posbench.data.corpora import (
    FILE_CORPORA,
    HUB_CORPORA,
    SPLITS,
    DataError,
    check_utf8,
    file_sha256,
    hub_identity,
    load_hub_corpus,
)

CACHE_VERSION = 1  # bump when the tokenization below changes
EOS = "<|endoftext|>"  # appended after every document
LIMITS = ("tokenizer_train_chars", "max_train_docs", "max_train_tokens")  # optional budgets, None = no limit


@dataclass
class Corpus:
    """A prepared corpus. ``tokens[split]`` is a 1-D uint16/uint32 memmap of token ids, documents
    separated by the ``<|endoftext|>`` id; ``tokenizer_path`` is the trained ``tokenizers`` JSON.

    ``same_as`` maps a split that holds another split's documents to that split: ``{"test": "validation"}``
    for data=text without ``data.test_files`` (its test split is the validation files), ``{}`` otherwise;
    ``same_as.get(split, split)`` is the split whose text is actually scored."""

    name: str
    key: str
    root: Path
    tokens: dict
    vocab_size: int
    tokenizer_path: Path
    same_as: dict = field(default_factory=dict)
    eos_token: str = EOS

    @cached_property
    def eos(self) -> int:
        """The id of the token between documents (``<|endoftext|>``, or a pretrained tokenizer's own end of text; the
        separator of copy windows)."""
        return Tokenizer.from_file(str(self.tokenizer_path)).token_to_id(self.eos_token)


def cache_root(cache_dir: str | None) -> Path:
    """``cache_dir``, else $POSBENCH_CACHE, else ~/.cache/posbench."""
    return Path(cache_dir or os.environ.get("POSBENCH_CACHE") or Path.home() / ".cache" / "posbench").expanduser()


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenization) trained on ``texts``, with ``<|endoftext|>`` as id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _first_chars(ds, max_chars: Optional[int]):
    """The documents of ``ds`` in order, cut off after ``max_chars`` characters in all (None: all of them)."""
    for batch in ds.iter(batch_size=256):
        for text in batch["text"]:
            if max_chars is not None:
                if max_chars <= 0:
                    return
                text, max_chars = text[:max_chars], max_chars - len(text)
            yield text


def _write_split(ds, tok, path: Path, num_proc: int, max_tokens: Optional[int] = None, eos_token: str = EOS) -> int:
    """Tokenize a split in batches and write ids + ``eos_token`` per document; return the count of ids written.

    Without a budget through ``datasets.map`` (``num_proc`` workers); with ``max_tokens`` lazily, stopping
    once the budget is written (the last document cut)."""
    from datasets.utils import tqdm  # here, not at the top: only building a cache needs it (0.5 s of start-up)

    eos = tok.token_to_id(eos_token)
    dtype = np.uint16 if tok.get_vocab_size() <= 65536 else np.uint32

    def encode(batch):
        return {"ids": [e.ids + [eos] for e in tok.encode_batch(batch["text"])]}

    if max_tokens is None:  # the map's Arrow file goes to the build folder's hf/, never beside the source
        (path.parent / "hf").mkdir(exist_ok=True)
        ids = ds.map(encode, batched=True, batch_size=64, num_proc=num_proc if num_proc > 1 else None,
                     remove_columns=ds.column_names, desc=f"tokenizing {path.stem}",
                     cache_file_name=str(path.parent / "hf" / f"{path.stem}-ids.arrow"))
        batches = (batch["ids"] for batch in ids.iter(batch_size=256))
    else:
        bar = tqdm(total=max_tokens, unit="tok", desc=f"tokenizing {path.stem} (budget)")
        batches = (encode(batch)["ids"] for batch in ds.iter(batch_size=16))
    count = 0
    with open(path, "wb") as f:
        for docs in batches:
            arr = np.fromiter((t for doc in docs for t in doc), dtype=dtype)
            if max_tokens is not None:
                arr = arr[: max_tokens - count]
                bar.update(arr.size)
            f.write(arr.tobytes())
            count += arr.size
            if max_tokens is not None and count >= max_tokens:
                break
    if max_tokens is not None:
        bar.close()
    return count


def _load_files(split_files: dict, clean, cache_dir: str | None):
    """The files of each split ({split: [paths]}) as a ``datasets.DatasetDict``, a document per file, each passed
    through ``clean`` (None: as read). Raises DataError for a file that is not UTF-8 (``corpora.check_utf8``)."""
    import datasets  # (as in _write_split)

    for split, files in split_files.items():  # read once, when the cache is built: a cached corpus is not re-read
        for f in files:
            check_utf8(f, f"data.{split}_files")
    ds = datasets.load_dataset("text", data_files={s: [str(f) for f in fs] for s, fs in split_files.items()},
                               sample_by="document", cache_dir=str(cache_root(cache_dir) / "hf"))
    if clean is not None:
        ds = ds.map(lambda b: {"text": [clean(t) for t in b["text"]]}, batched=True, desc="cleaning")
    return ds


def prepare(name: str, vocab_size: int, cache_dir: str | None = None, num_proc: int = 1, passkey_rate: float = 0.0,
            tokenizer: Tokenizer | None = None, **options) -> Corpus:
    """Load corpus ``name``, train its tokenizer (or take ``tokenizer``) and cache its token ids; reuse the cache when
    present.

    Args:
        name: a key of :data:`FILE_CORPORA` or :data:`HUB_CORPORA`.
        vocab_size: BPE vocabulary size, special token included (ignored with ``tokenizer``).
        tokenizer: a pretrained checkpoint's tokenizer (posbench/model/pretrained.py) to tokenise with instead of
            training one; the cache is keyed by its JSON's sha256, and documents end with its ``<|endoftext|>``
            where it has one, else its end-of-text token (its ``eos_token`` in the JSON's added tokens, see
            :func:`end_of_text`).
        num_proc: tokenization worker processes (``datasets.map``).
        passkey_rate: ``data.passkey_rate``, a training option (needles inserted into training windows,
            posbench/evaluation/passkey.py), not part of the corpus: ignored here.
        options: the corpus's own settings (``validation``/``test`` plays, ``*_files``; ``path``: a local copy
            of a paper corpus) and the budgets, each None for no limit: ``tokenizer_train_chars`` (train the
            BPE on the first N characters of train), ``max_train_docs`` (keep the first N train documents),
            ``max_train_tokens`` (cut the train ids after N tokens).
    Concurrent calls on one machine (torchrun ranks, sweep jobs) build the cache once: the first takes a lock
    file beside it (``<cache>.lock``) and builds; the others wait for it and read the finished copy.

    Returns:
        the :class:`Corpus`; its memmaps hold ``meta["tokens"][split]`` ids each.
    Raises:
        DataError: unknown corpus, missing/empty files, a file's content in two splits (data=text's test split
            falling back to the validation files excepted), unknown play names, an unreachable or unreadable
            paper corpus (see :func:`load_hub_corpus`), a non-positive budget, an empty split.
    """
    limits = {k: options.get(k) for k in LIMITS}
    for k, v in limits.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise DataError(f"data.{k}={v!r} is not allowed: it must be a positive integer or null (no limit)")
    if name in FILE_CORPORA:
        split_files_of, clean = FILE_CORPORA[name]
        split_files = split_files_of(**options)
        identity = {"version": CACHE_VERSION, "corpus": name, "vocab_size": vocab_size,
                    "files": {s: [[f.name, file_sha256(f)] for f in fs] for s, fs in split_files.items()}}
        load = lambda tmp: _load_files(split_files, clean, cache_dir)  # noqa: E731
    elif name in HUB_CORPORA:
        path = options.get("path")
        identity = {"version": CACHE_VERSION, "corpus": name, "vocab_size": vocab_size, **hub_identity(name, path)}
        load = lambda tmp: load_hub_corpus(name, path, limits["max_train_docs"], str(tmp / "hf"))  # noqa: E731
    else:
        raise DataError(f"unknown corpus {name!r}; choose one of: {', '.join(sorted([*FILE_CORPORA, *HUB_CORPORA]))}")
    identity.update({k: v for k, v in limits.items() if v is not None})  # absent when unset: old keys stay valid
    if tokenizer is not None:
        identity.update(vocab_size=tokenizer.get_vocab_size(), eos=end_of_text(tokenizer),
                        tokenizer=hashlib.sha256(tokenizer.to_str().encode()).hexdigest())
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    root = cache_root(cache_dir) / f"{name}-{key}"
    if not (root / "meta.json").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        with open(root.with_name(f"{root.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one build per cache: the other processes of this machine (torchrun
            if not (root / "meta.json").exists():  # ranks, sweep jobs) wait here, then use the finished copy
                _build_into(root, identity, load, vocab_size, num_proc, limits, tokenizer)
    return load_cached(root)


def end_of_text(tokenizer: Tokenizer) -> str:
    """The token a pretrained ``tokenizer`` ends documents with: ``<|endoftext|>`` where its vocabulary has it
    (GPT-2, SmolLM, Qwen), else the first special token of ``</s>``, ``<|end_of_text|>`` (Llama 3), ``<|im_end|>``.
    Raises DataError where it has none of them."""
    for token in (EOS, "</s>", "<|end_of_text|>", "<|im_end|>"):
        if tokenizer.token_to_id(token) is not None:
            return token
    raise DataError("the checkpoint's tokenizer has no end-of-text token (<|endoftext|>, </s>, <|end_of_text|> or "
                    "<|im_end|>) to put between documents")


def _build_into(root: Path, identity: dict, load, vocab_size: int, num_proc: int, limits: dict,
                tokenizer: Tokenizer | None = None) -> None:
    """Build the cache in a temporary folder beside ``root`` and rename it to ``root`` (atomic: a concurrent
    reader sees nothing or the whole folder, e.g. on a shared file system where the lock does not reach)."""
    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _build(tmp, identity, load(tmp), vocab_size, num_proc, limits, tokenizer)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(root)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another machine's run finished first; use its copy


def _build(tmp: Path, identity: dict, ds, vocab_size: int, num_proc: int, limits: dict,
           tokenizer: Tokenizer | None = None) -> None:
    """Train the tokenizer on ``ds["train"]`` (or take ``tokenizer``); write tokenizer.json, <split>.bin and meta.json
    into ``tmp``."""
    if limits["max_train_docs"] is not None and len(ds["train"]) > limits["max_train_docs"]:
        ds["train"] = ds["train"].select(range(limits["max_train_docs"]))
    for s in SPLITS:
        if len(ds[s]) == 0:
            raise DataError(f"data={identity['corpus']}: the {s} split holds no documents")
    tok = tokenizer or train_tokenizer(_first_chars(ds["train"], limits["tokenizer_train_chars"]), vocab_size)
    tok.save(str(tmp / "tokenizer.json"))
    budget, eos = {"train": limits["max_train_tokens"]}, identity.get("eos", EOS)  # validation/test are always whole
    counts = {s: _write_split(ds[s], tok, tmp / f"{s}.bin", num_proc, budget.get(s), eos) for s in SPLITS}
    meta = {**identity, "vocab_size": tok.get_vocab_size(), "tokens": counts,
            "dtype": "uint16" if tok.get_vocab_size() <= 65536 else "uint32"}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(tmp / "hf", ignore_errors=True)  # streamed splits and articles: only the ids are kept


def load_cached(root: Path) -> Corpus:
    """Open a prepared corpus folder (``meta.json``, ``tokenizer.json``, ``<split>.bin``).

    ``same_as`` comes from the per-split file lists meta.json has always recorded (file corpora): a test
    split of the validation split's files (names and SHA-256, in order) is ``{"test": "validation"}``."""
    meta = json.loads((root / "meta.json").read_text())
    tokens = {s: np.memmap(root / f"{s}.bin", dtype=meta["dtype"], mode="r") for s in SPLITS}
    files = meta.get("files") or {}
    same_as = {"test": "validation"} if files.get("test") and files["test"] == files.get("validation") else {}
    return Corpus(meta["corpus"], root.name, root, tokens, meta["vocab_size"], root / "tokenizer.json", same_as,
                  meta.get("eos", EOS))
