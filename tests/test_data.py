"""posbench.data: the paper-corpus loaders driven end to end with small local copies in the Hub schema,
the cache key and its reuse, the one-line error without network, and the file corpora (data=text).

CPU only, no network (the Hub is switched off and any socket connection fails), a few seconds.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import json  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from posbench import corpora, data  # noqa: E402

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
    for s in data.SPLITS:
        assert meta["tokens"][s] > 0
        assert len(corpus.tokens[s]) == meta["tokens"][s]
        assert int(corpus.tokens[s].max()) < corpus.vocab_size
    assert corpus.vocab_size <= VOCAB
    return meta


# ---- paper corpora ----------------------------------------------------------------------------


def test_wikitext103_from_save_to_disk(tmp_path):
    wikitext_dict().save_to_disk(str(tmp_path / "wt103"))
    corpus = data.prepare("wikitext103", VOCAB, str(tmp_path / "cache"), path=str(tmp_path / "wt103"))
    meta = check_corpus(corpus)
    assert meta["hub"] == "Salesforce/wikitext" and meta["config"] == "wikitext-103-raw-v1"
    text = decode(corpus, "validation")
    assert KNOWN in text and " = Article 1-1 = \n" in text and " = = History = = \n" in text
    eos = Tokenizer.from_file(str(corpus.tokenizer_path)).token_to_id(data.EOS)
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
    corpus = data.prepare("wikitext2", VOCAB, str(tmp_path / "cache"), path=str(tmp_path / "clone"))
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
    full = data.prepare("pg19", VOCAB, cache, path=str(path))
    check_corpus(full)
    assert sorted(map(str, path.rglob("*"))) == before  # nothing written beside the user's copy
    assert "The end of Book 4." in decode(full, "train")
    assert "The end of Valid Two." in decode(full, "validation")

    two = data.prepare("pg19", VOCAB, cache, path=str(path), max_train_docs=2)
    meta = check_corpus(two)
    train = decode(two, "train")
    assert "The end of Book 1." in train and "BOOK 2" not in train
    assert meta["max_train_docs"] == 2 and two.root != full.root
    assert meta["tokens"]["validation"] == json.loads((full.root / "meta.json").read_text())["tokens"]["validation"]

    cut = data.prepare("pg19", VOCAB, cache, path=str(path), max_train_tokens=100, tokenizer_train_chars=2000)
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
    pg = data.prepare("pg19", VOCAB, cache, max_train_docs=3)
    wt = data.prepare("wikitext103", VOCAB, cache)
    assert calls == [("deepmind/pg19", None, True), ("Salesforce/wikitext", "wikitext-103-raw-v1", False)]
    assert read.count("train") <= 4 and read.count("validation") == 2  # 3 books kept, at most 1 read ahead
    assert "The end of Book 2." in decode(pg, "train") and KNOWN in decode(wt, "validation")
    assert json.loads((pg.root / "meta.json").read_text())["hub"] == "deepmind/pg19"
    monkeypatch.setattr(datasets, "load_dataset", real)
    assert data.prepare("pg19", VOCAB, cache, max_train_docs=3).root == pg.root
    with pytest.raises(data.DataError, match="cannot be reached"):
        data.prepare("pg19", VOCAB, cache, max_train_docs=4)


def test_second_prepare_reuses_the_cache(tmp_path, monkeypatch):
    wikitext_dict().save_to_disk(str(tmp_path / "wt"))
    args = ("wikitext103", VOCAB, str(tmp_path / "cache"))
    first = data.prepare(*args, path=str(tmp_path / "wt"))
    stamp = (first.root / "meta.json").stat().st_mtime_ns

    def fail(*a, **k):
        raise AssertionError("rebuilt a cached corpus")

    monkeypatch.setattr(data, "train_tokenizer", fail)
    monkeypatch.setattr(data, "load_hub_corpus", fail)
    second = data.prepare(*args, path=str(tmp_path / "wt"))
    assert second.root == first.root and (second.root / "meta.json").stat().st_mtime_ns == stamp
    np.testing.assert_array_equal(second.tokens["train"], first.tokens["train"])


def test_cache_key_covers_content_tokenizer_and_budget(tmp_path):
    cache = str(tmp_path / "cache")
    wikitext_dict().save_to_disk(str(tmp_path / "wt"))
    base = data.prepare("wikitext103", VOCAB, cache, path=str(tmp_path / "wt")).root

    wikitext_dict(train=9).save_to_disk(str(tmp_path / "wt"))  # same folder, new content
    changed = data.prepare("wikitext103", VOCAB, cache, path=str(tmp_path / "wt")).root
    assert changed != base
    others = [data.prepare("wikitext103", VOCAB - 20, cache, path=str(tmp_path / "wt")).root,
              data.prepare("wikitext103", VOCAB, cache, path=str(tmp_path / "wt"), tokenizer_train_chars=5000).root,
              data.prepare("wikitext103", VOCAB, cache, path=str(tmp_path / "wt"), max_train_docs=3).root]
    assert len({base, changed, *others}) == 5
    assert corpora.hub_identity("wikitext2", str(tmp_path / "wt"))["config"] == "wikitext-2-raw-v1"

    folder = write_parquet(pg19_dict(), tmp_path / "pg")
    a = corpora.hub_identity("pg19", str(folder))
    (folder / "test-00000-of-00001.parquet").unlink()
    pg19_dict()["test"].select([0, 0]).to_parquet(str(folder / "test-00000-of-00001.parquet"))
    assert corpora.hub_identity("pg19", str(folder))["content"] != a["content"]


@pytest.mark.parametrize("name", ["wikitext103", "wikitext2", "pg19"])
def test_no_network_no_copy_is_one_line(tmp_path, name):
    with pytest.raises(data.DataError) as err:
        data.prepare(name, VOCAB, str(tmp_path / "cache"))
    msg = str(err.value)
    assert "\n" not in msg
    assert "cannot be reached" in msg and "not cached" in msg
    for needle in ("data=shakespeare", "data=text", "data.path=<local copy>"):
        assert needle in msg
    assert not list((tmp_path / "cache").glob("*.tmp-*"))  # the half-built folder is gone


def test_cli_prints_the_no_network_error_on_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"),
           "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "posbench", "train", "data=wikitext103", "train.steps=1",
                           f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("posbench: error:")]
    assert len(lines) == 1 and "data=shakespeare" in lines[0] and "data.path=<local copy>" in lines[0]


def test_bad_local_copies(tmp_path):
    with pytest.raises(data.DataError, match="is not a folder"):
        data.prepare("wikitext103", VOCAB, str(tmp_path / "cache"), path=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.DataError, match="datasets cannot read"):
        data.prepare("wikitext103", VOCAB, str(tmp_path / "cache"), path=str(tmp_path / "empty"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "one"))
    with pytest.raises(data.DataError, match="no validation/test split"):
        data.prepare("wikitext103", VOCAB, str(tmp_path / "cache"), path=str(tmp_path / "one"))
    d = pg19_dict().rename_column("text", "body")
    d.save_to_disk(str(tmp_path / "body"))
    with pytest.raises(data.DataError, match="no 'text' column"):
        data.prepare("pg19", VOCAB, str(tmp_path / "cache"), path=str(tmp_path / "body"))
    with pytest.raises(data.DataError, match="max_train_docs=0"):
        data.prepare("pg19", VOCAB, str(tmp_path / "cache"), path=str(tmp_path / "body"), max_train_docs=0)
    with pytest.raises(data.DataError, match="unknown corpus 'wiki'.*pg19.*wikitext103"):
        data.prepare("wiki", VOCAB, str(tmp_path / "cache"))


# ---- data=text (file corpora) -----------------------------------------------------------------


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
    corpus = data.prepare("text", VOCAB, str(tmp_path / "cache"), **files)
    meta = check_corpus(corpus)
    assert [f[0] for f in meta["files"]["train"]] == ["a.txt", "b.txt"]  # recursive, sorted, hidden skipped
    assert meta["files"]["test"] == meta["files"]["validation"]
    assert "tokenizer_train_chars" not in meta and "max_train_docs" not in meta  # unset budgets: keys unchanged
    assert decode(corpus, "validation") == KNOWN + FILLER[0]
    (tmp_path / "train" / "a.txt").write_text("".join(FILLER * 3))  # rewritten, same bytes: same key
    assert data.prepare("text", VOCAB, str(tmp_path / "cache"), **files).root == corpus.root
    (tmp_path / "valid.txt").write_text(KNOWN)
    assert data.prepare("text", VOCAB, str(tmp_path / "cache"), **files).root != corpus.root


def test_text_missing_and_empty_files(tmp_path):
    files = text_files(tmp_path)
    with pytest.raises(data.DataError, match=r"data.train_files: .*x.txt' does not exist"):
        data.prepare("text", VOCAB, str(tmp_path / "cache"), **{**files, "train_files": [str(tmp_path / "x.txt")]})
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(data.DataError, match=r"data.validation_files: file .*e.txt' is empty"):
        data.prepare("text", VOCAB, str(tmp_path / "cache"), **{**files, "validation_files": [str(tmp_path / "e.txt")]})
    (tmp_path / "nothing").mkdir()
    with pytest.raises(data.DataError, match="holds no files"):
        data.prepare("text", VOCAB, str(tmp_path / "cache"), **{**files, "test_files": [str(tmp_path / "nothing")]})
    with pytest.raises(data.DataError, match="needs data.train_files and data.validation_files"):
        data.prepare("text", VOCAB, str(tmp_path / "cache"), train_files=[], validation_files=[], test_files=[])
