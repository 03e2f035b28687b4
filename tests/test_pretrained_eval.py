"""``posbench eval pretrained=…`` (posbench/jobs/eval_job.py; issue 47 item 2, the command): a random tiny Llama
checkpoint saved by transformers with its tokenizer, as a folder and as a Hub id in a local cache, is scored on the
embedded corpus tokenised by its own tokenizer; the perplexity at L and past it is transformers' own forward on the
same windows of the corpus as transformers' tokenizer spells it; the record names the checkpoint (source, the weights'
sha256 computed here, its family and L); options given at evaluation label it; and each bad input is one line, exit 2,
nothing written.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import eval_here, ok, refused, snapshot  # noqa: E402
from posbench.data.cache import train_tokenizer  # noqa: E402
from posbench.data.corpora import _clean_markdown, shakespeare_plays  # noqa: E402
from posbench.report.records import collect  # noqa: E402

V, L = 300, 64  # vocabulary (a byte-level BPE's 256 bytes and some merges), the config's max_position_embeddings
DATA = ("data=shakespeare", "data.max_train_tokens=4096")  # the default corpus, its train split cut (only the
# validation split is scored)


def save_checkpoint(folder: Path, tokenizer: bool = True, **config) -> transformers.LlamaForCausalLM:
    """A random tiny Llama (GQA, untied head) saved in ``folder``, with a BPE tokenizer trained on one play."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=V, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=L, tie_word_embeddings=False, pad_token_id=None,
                 bos_token_id=None, eos_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**sizes, **config})).eval()
    model.save_pretrained(folder)
    if tokenizer:
        text = _clean_markdown(shakespeare_plays()["macbeth"].read_text())
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=train_tokenizer([text], V),
                                                    eos_token="<|endoftext|>")
        fast.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("checkpoints") / "tiny-llama"
    save_checkpoint(folder)
    return folder


def expected_ppl(folder: Path, length: int, targets: int) -> float:
    """transformers' perplexity on the first ``targets`` targets of the validation plays (hamlet, the-tempest, each
    followed by <|endoftext|>) in nonoverlapping windows of ``length`` inputs, by transformers' tokenizer and model."""
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    stream = []
    for play in ("hamlet", "the-tempest"):
        stream += tok(_clean_markdown(shakespeare_plays()[play].read_text()))["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor(stream[: targets + 1])
    nll = []
    with torch.no_grad():
        for a in range(0, targets, length):
            x, y = ids[a: a + length], ids[a + 1: a + length + 1]
            nll.append(torch.nn.functional.cross_entropy(model(x[None]).logits[0], y, reduction="none"))
    return math.exp(torch.cat(nll).mean().item())


def test_a_checkpoint_folder_is_scored_as_transformers_scores_it(tiny, tmp_path, monkeypatch, torch_state, data_cache):
    monkeypatch.chdir(tmp_path)
    rec = eval_here(f"pretrained={tiny}", *DATA, f"data.cache_dir={data_cache}", "eval.lengths=[64,128]",
                    "eval.max_tokens=1280", "threads=1")
    written = tmp_path / "outputs" / "pretrained" / "tiny-llama"
    assert sorted(p.name for p in written.glob("eval-*")) == ["eval-tiny-llama-nonoverlapping-validation-1.csv",
                                                              "eval-tiny-llama-nonoverlapping-validation-1.json"]
    for row in rec["results"]:  # at L and at 2L, past max_position_embeddings
        assert row["ppl"] == pytest.approx(expected_ppl(tiny, row["length"], 1280), rel=1e-5), row["length"]
    assert rec["label"] == "tiny-llama" and rec["model"] == "tiny-llama" and rec["train_length"] == L
    weights = hashlib.sha256((tiny / "model.safetensors").read_bytes()).hexdigest()
    assert rec["pretrained"] == {"name": "tiny-llama", "source": str(tiny), "sha256": weights, "family": "llama",
                                 "train_length": L, "quantisation": None}
    saved = json.loads(next(written.glob("eval-*.json")).read_text())
    assert saved["pretrained"]["sha256"] == weights and saved["config"]["model"]["block"] == "llama"
    csv = next(written.glob("eval-*.csv")).read_text().splitlines()
    header, first = csv[0].split(","), csv[1].split(",")
    assert first[header.index("checkpoint")] == str(tiny) and first[header.index("checkpoint_sha256")] == weights


def test_the_lengths_default_to_a_quarter_to_four_times_l(tiny, tmp_path, monkeypatch, torch_state, data_cache):
    monkeypatch.chdir(tmp_path)
    rec = eval_here(f"pretrained={tiny}", *DATA, f"data.cache_dir={data_cache}", "eval.max_tokens=256", "threads=1")
    assert rec["lengths"] == [L // 4, L // 2, L, 2 * L, 4 * L]


def test_options_given_at_evaluation_are_in_the_label(tiny, tmp_path, monkeypatch, torch_state, data_cache):
    monkeypatch.chdir(tmp_path)
    common = (f"pretrained={tiny}", *DATA, f"data.cache_dir={data_cache}", "eval.lengths=[64,256]",
              "eval.max_tokens=256", "threads=1")
    yarn = eval_here(*common, "scheme.scaling=yarn", "scheme.factor=4")
    assert yarn["label"] == "tiny-llama (yarn×4 at eval)" and yarn["scheme_overrides"]["scaling"] == "yarn"
    remapped = eval_here(*common, "eval.remap=self_extend", "eval.remap_options.window=16",
                         "eval.remap_options.group=4")
    assert remapped["label"] == "tiny-llama (self_extend(W16,G4) at eval)"
    assert remapped["config"]["eval"]["remap"] == "self_extend" and "scheme_overrides" not in remapped
    assert eval_here(*common)["label"] == "tiny-llama"
    assert len(list((tmp_path / "outputs" / "pretrained" / "tiny-llama").glob("eval-*.json"))) == 3
    records, skipped = collect([tmp_path / "outputs" / "pretrained"])  # the report's rows: the checkpoint's labels
    assert sorted(r["label"] for r in records) == ["tiny-llama", "tiny-llama (self_extend(W16,G4) at eval)",
                                                   "tiny-llama (yarn×4 at eval)"] and not skipped


def test_results_go_to_hydra_run_dir_where_given(tiny, run_cli, data_cache, tmp_path):
    """``hydra.run.dir`` moves a pretrained checkpoint's results from outputs/pretrained/<name>, as it moves any Hydra
    job's folder."""
    ok(run_cli("eval", f"pretrained={tiny}", *DATA, f"data.cache_dir={data_cache}", "eval.lengths=[64]",
               "eval.max_tokens=64", "threads=1", "hydra.run.dir=mine", cwd=tmp_path))
    here = tmp_path
    assert [p.name for p in (here / "mine").glob("eval-*.json")] == ["eval-tiny-llama-nonoverlapping-validation-1.json"]
    assert not (here / "outputs").exists()


def test_a_hub_id_in_the_local_cache_is_read_offline(tiny, tmp_path, monkeypatch, torch_state, data_cache):
    """The Hub cache's layout (models--<org>--<name>/snapshots/<commit>/, refs/main), made here, is what the Hub id is
    read from with HF_HUB_OFFLINE=1; the record names the id."""
    import huggingface_hub.constants

    snap = tmp_path / "hub" / "models--acme--tiny-llama" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny, snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    rec = eval_here("pretrained=acme/tiny-llama", *DATA, f"data.cache_dir={data_cache}", "eval.lengths=[64]",
                    "eval.max_tokens=128", "threads=1")
    assert rec["pretrained"]["source"] == "acme/tiny-llama" and rec["label"] == "tiny-llama"
    assert rec["pretrained"]["sha256"] == hashlib.sha256((tiny / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("case", ["llama_yarn", "llama_llama3", "mistral_window", "qwen2", "qwen3", "smollm3"])
def test_the_evaluated_model_of_each_family_gives_transformers_logits(tmp_path, case, tiny, data_cache):
    """The model ``posbench eval pretrained=`` scores (built from the run config the checkpoint's config becomes) gives
    transformers' logits past the checkpoint's length, as tests/test_pretrained.py's model of its spec does."""
    from hydra import compose, initialize_config_module

    from posbench.cli import register
    from posbench.jobs import eval_job
    from test_pretrained import T, checkpoint

    folder, hf = checkpoint(tmp_path, case)
    transformers.AutoTokenizer.from_pretrained(tiny).save_pretrained(folder)  # (its corpus is prepared, not scored)
    register()
    with initialize_config_module("posbench.conf", version_base="1.3"):
        cfg = compose("eval", overrides=[f"pretrained={folder}", *DATA, f"data.cache_dir={data_cache}",
                                         "eval.lengths=[16]"])
    model = eval_job.prepare(cfg).model.double()
    ids = torch.randint(0, hf.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert (ours - theirs).abs().max() <= 1e-6 * theirs.abs().max(), (case, (ours - theirs).abs().max().item())


@pytest.fixture(scope="module")
def broken(tmp_path_factory, tiny) -> dict[str, Path]:
    """Checkpoints posbench refuses: a folder without a config, one of another family (GPT-2), one without a
    tokenizer, one whose query heads are not a multiple of its key/value heads."""
    root = tmp_path_factory.mktemp("broken")
    (root / "empty").mkdir()
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V)).save_pretrained(
        root / "gpt2")
    save_checkpoint(root / "no-tokenizer", tokenizer=False)
    save_checkpoint(root / "heads", num_attention_heads=4, num_key_value_heads=3, hidden_size=48)
    write_gguf(root / "tiny-Q8_1.gguf")
    return root


def write_gguf(path: Path) -> None:
    """A one-layer Llama GGUF file whose token embeddings are Q8_1 blocks (32 weights and their scale and sum in 40
    bytes), a type the gguf package cannot dequantise; the rest float32."""
    gguf = pytest.importorskip("gguf")
    writer, rng = gguf.GGUFWriter(str(path), "llama"), torch.Generator().manual_seed(0)
    writer.add_context_length(L), writer.add_embedding_length(32), writer.add_block_count(1)
    writer.add_feed_forward_length(64), writer.add_head_count(4), writer.add_head_count_kv(2)
    writer.add_rope_freq_base(500.0), writer.add_layer_norm_rms_eps(1e-5), writer.add_tokenizer_model("gpt2")
    writer.add_token_list([bytes([i]).decode("latin-1") for i in range(256)]), writer.add_token_types([1] * 256)
    writer.add_token_merges([]), writer.add_vocab_size(256)
    blocks, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    writer.add_tensor("token_embd.weight", torch.zeros(256, 32 // blocks * size, dtype=torch.uint8).numpy(),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    shapes = {"output_norm": (32,), "blk.0.attn_norm": (32,), "blk.0.ffn_norm": (32,), "blk.0.attn_q": (32, 32),
              "blk.0.attn_k": (16, 32), "blk.0.attn_v": (16, 32), "blk.0.attn_output": (32, 32),
              "blk.0.ffn_gate": (64, 32), "blk.0.ffn_up": (64, 32), "blk.0.ffn_down": (32, 64)}
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", torch.randn(shape, generator=rng).numpy())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()


REFUSALS = [  # (arguments, a part of the one line)
    (["pretrained=<root>/missing"], "pretrained=<root>/missing: no such file or folder"),
    (["pretrained=<root>/missing.gguf"], "no such file or folder"),
    (["pretrained=<root>/empty"], "the folder has no config.json"),
    (["pretrained=<root>/gpt2"], "model_type 'gpt2' is not a family posbench rebuilds; the families: llama, mistral"),
    (["pretrained=<root>/no-tokenizer"], "no tokenizer"),
    (["pretrained=<root>/heads"], "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    (["pretrained=<root>/tiny-Q8_1.gguf"], "transformers cannot read it: Dequantization for Q8_1 is not yet implemented"),
    (["pretrained=<tiny>", "scheme=alibi"], "scheme=alibi: the scheme cannot be changed by posbench eval"),
    (["pretrained=<tiny>", "model.n_head=8"], "model.n_head=8: <tiny> has model.n_head=4"),
    (["pretrained=<tiny>", "model.n_kv_head=1"], "model.n_kv_head=1: <tiny> has model.n_kv_head=2"),
    (["pretrained=<tiny>", "model.block=gpt"], "model.block=gpt: <tiny> has model.block=llama"),
    (["pretrained=acme/not-cached"], "no Hub model of that id in the local Hugging Face cache"),
    (["pretrained=<tiny>", "run=<root>"], "run=… and pretrained=… given together"),
    (["eval.split=test"], "nothing to evaluate"),
    (["pretrained=<tiny>", "scheme.max_positions=100"], "<tiny> has the rope scheme, which has no option 'max_positions'"),
]


@pytest.mark.parametrize("args, message", REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_a_bad_checkpoint_or_option_gets_one_line_and_nothing_written(posbench_here, broken, tiny, monkeypatch, args,
                                                                       message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(broken / "hub"))
    here = Path(os.getcwd())
    before = snapshot(here)
    proc = posbench_here("eval", *(a.replace("<root>", str(broken)).replace("<tiny>", str(tiny)) for a in args))
    said = refused(proc, here, before).replace(str(broken), "<root>").replace(str(tiny), "<tiny>")
    assert message in said, said
