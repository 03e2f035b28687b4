"""``init_from=<pretrained checkpoint>`` (posbench/training/lineage.py; issue 48 item 2): a random tiny Llama saved by
transformers with its tokenizer (L = 64) is fine-tuned as a posbench parent is. With 0 steps the run scores the
checkpoint as transformers does on the same windows; every extension recipe (the control at L, direct, PI, NTK, YaRN,
Llama 3's scaling, PoSE) trains end to end; the record names the checkpoint as the parent (its weights' sha256, computed
here) and the report finds it beside the checkpoint's own evaluation; the fine-tune is evaluated later on the corpus its
checkpoint's tokenizer tokenised; a posbench run exported as a Hugging Face folder and started from scores as the run
did; a killed fine-tune resumes bit-identically; bad inputs get one line, exit 2, nothing written.
"""

from __future__ import annotations

import hashlib
import json
import math

import pytest

transformers = pytest.importorskip("transformers")

from helpers import eval_here, refused, rows, run_into, snapshot  # noqa: E402
from posbench.report.records import collect  # noqa: E402
from test_pretrained_eval import L, V, expected_ppl, save_checkpoint  # noqa: E402
from test_resume import cli, kill_and_resume  # noqa: E402

DATA = ("data.max_train_tokens=4096", "train.threads=1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoints") / "tiny-llama"
    save_checkpoint(folder)
    return folder


def record(run) -> dict:
    return json.loads((run / "results.json").read_text())


def finetune(run_cli, data_cache, run, tiny, *overrides):
    proc = run_into(run_cli, data_cache, run, f"init_from={tiny}", *DATA, *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return record(run)


def test_zero_steps_scores_the_checkpoint_as_transformers_does(run_cli, data_cache, tiny, tmp_path):
    rec = finetune(run_cli, data_cache, tmp_path / "zero", tiny, "train.steps=0", f"train.seq_len={L}",
                   f"eval.lengths=[{L}]", "eval.max_tokens=256")
    assert rec["results"][0]["ppl"] == pytest.approx(expected_ppl(tiny, L, 256), rel=1e-4)
    sha = hashlib.sha256((tiny / "model.safetensors").read_bytes()).hexdigest()
    assert rec["lineage"]["pretrained"]["sha256"] == sha and rec["lineage"]["pretrained"]["source"] == str(tiny)
    assert rec["lineage"]["train_length"] == rec["lineage"]["origin_length"] == L
    m = rec["config"]["model"]  # every size and option the checkpoint's config gives, none of model=tiny's
    assert (m["block"], m["n_layer"], m["d_model"], m["n_head"], m["n_kv_head"], m["d_ff"], m["tie_head"]) == \
        ("llama", 2, 32, 4, 2, 56, False)
    assert rec["config"]["data"]["tokenizer"] == str(tiny) and rec["config"]["data"]["vocab_size"] == V
    assert rec["label"].startswith("tiny-llama rope ft64×0"), rec["label"]


RECIPES = {  # the experiment=extend recipes at 4L, PoSE, and the control that trains on at L
    "control": [f"train.seq_len={L}"],
    "direct": [f"train.seq_len={4 * L}"],
    "pi": ["+extend=pi", f"train.seq_len={4 * L}"],
    "ntk": ["+extend=ntk", f"train.seq_len={4 * L}"],
    "yarn": ["+extend=yarn", f"train.seq_len={4 * L}"],
    "llama3": ["scheme.scaling=llama3", "scheme.factor=4", f"train.seq_len={4 * L}"],
    "pose": [f"train.seq_len={L}", f"train.pose={4 * L}"],
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_fine_tunes_a_checkpoint(run_cli, data_cache, tiny, tmp_path, recipe):
    rec = finetune(run_cli, data_cache, tmp_path / recipe, tiny, *RECIPES[recipe], f"eval.lengths=[{L},{4 * L}]")
    assert rec["status"] == "complete" and rec["lineage"]["pretrained"]["name"] == "tiny-llama"
    losses = [r["loss"] for r in rows(tmp_path / recipe)]
    assert len(losses) == 4 and all(0 < x < 2 * math.log(V) for x in losses), losses  # trained from the checkpoint
    assert [r["length"] for r in rec["results"]] == [L, 4 * L]


def test_the_report_puts_a_fine_tune_beside_the_checkpoints_own_curve(run_cli, data_cache, tiny, tmp_path,
                                                                     monkeypatch, torch_state):
    monkeypatch.chdir(tmp_path)  # the checkpoint's evaluation writes into outputs/pretrained/tiny-llama here
    own = eval_here(f"pretrained={tiny}", f"eval.lengths=[{L},{4 * L}]", "eval.max_tokens=256", "threads=1",
                    "data=shakespeare", f"data.cache_dir={data_cache}", "data.max_train_tokens=4096")
    finetune(run_cli, data_cache, tmp_path / "ft", tiny, "+extend=yarn", f"train.seq_len={4 * L}",
             f"eval.lengths=[{L},{4 * L}]", "eval.max_tokens=256")
    records, _ = collect([tmp_path / "outputs", tmp_path / "ft"])
    ft = next(r for r in records if r.get("lineage"))
    checkpoint = next(r for r in records if r.get("pretrained"))
    assert checkpoint["label"] == own["label"] and ft["parent"] == checkpoint["setting"]


def test_a_fine_tune_is_evaluated_on_its_checkpoints_tokens(run_cli, data_cache, tiny, tmp_path, torch_state):
    """``posbench eval run=<fine-tune>`` tokenises with the checkpoint's tokenizer (``data.tokenizer``), not a BPE of
    its own: with 0 steps it scores what transformers scores."""
    run = tmp_path / "zero"
    finetune(run_cli, data_cache, run, tiny, "train.steps=0", f"train.seq_len={L}", f"eval.lengths=[{L}]",
             "eval.max_tokens=256")
    again = eval_here(f"run={run}", f"eval.lengths=[{L}]", "eval.max_tokens=512", "threads=1")
    assert again["results"][0]["ppl"] == pytest.approx(expected_ppl(tiny, L, 512), rel=1e-4)


def test_an_exported_run_started_from_scores_as_the_run(run_cli, data_cache, tmp_path):
    """``posbench export`` then ``init_from=<the export>``: the Hugging Face folder's weights, config and tokenizer
    rebuild the run's model and its corpus's token ids, so 0 steps give the run's own perplexities."""
    run, hf = tmp_path / "run", tmp_path / "hf"
    proc = run_into(run_cli, data_cache, run, "model.block=llama", "model.n_kv_head=2", "train.threads=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = run_cli("export", f"run={run}", f"out={hf}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = finetune(run_cli, data_cache, tmp_path / "again", hf, "train.steps=0")
    assert [(r["length"], r["tokens"]) for r in again["results"]] == [(r["length"], r["tokens"]) for r in record(run)["results"]]
    for mine, theirs in zip(again["results"], record(run)["results"]):
        assert mine["ppl"] == pytest.approx(theirs["ppl"], rel=1e-5)


def test_a_killed_fine_tune_of_a_checkpoint_resumes_bit_identically(data_cache, tiny, tmp_path):
    args = [f"init_from={tiny}", *DATA, "+extend=yarn", f"train.seq_len={2 * L}", "scheme.factor=2", "train.steps=12",
            "train.checkpoint_every=4", "train.log_every=1", f"eval.lengths=[{L},{2 * L}]", "eval.max_tokens=256"]
    a = cli(tmp_path / "A", data_cache, *args)
    assert a.returncode == 0, a.stdout + a.stderr
    run = tmp_path / "B"
    kill_and_resume(run, data_cache, *args)
    assert [(r["step"], r["loss"]) for r in rows(run)] == [(r["step"], r["loss"]) for r in rows(tmp_path / "A")]
    assert record(run)["param_sha256"] == record(tmp_path / "A")["param_sha256"]


@pytest.mark.parametrize("overrides, message", [
    (["scheme=alibi"], "scheme=alibi but init_from=<ckpt> was trained with scheme=rope"),
    (["data.vocab_size=4096"], f"data.vocab_size=4096 but init_from=<ckpt> has data.vocab_size={V}: its tokenizer"),
    (["+extend=pi", f"train.seq_len={L // 2}"], f"train.seq_len={L // 2} is shorter than the L={L} of init_from=<ckpt>"),
    (["model.n_layer=3"], "model.n_layer=3 but init_from=<ckpt> has model.n_layer=2"),
    (["data.tokenizer=other/tokenizer"], "data.tokenizer=other/tokenizer but init_from=<ckpt> tokenises with"),
])
def test_bad_fine_tunes_of_a_checkpoint_are_refused(run_cli, data_cache, tiny, tmp_path, overrides, message):
    run = tmp_path / "run"
    before = snapshot(tmp_path)
    line = refused(run_into(run_cli, data_cache, run, f"init_from={tiny}", *DATA, *overrides), tmp_path, before)
    assert line.replace(str(tiny), "<ckpt>").startswith(message), line


def test_a_missing_checkpoint_is_refused(run_cli, data_cache, tmp_path):
    before = snapshot(tmp_path)
    line = refused(run_into(run_cli, data_cache, tmp_path / "run", f"init_from={tmp_path}/nothing.gguf"), tmp_path, before)
    assert line == f"init_from={tmp_path}/nothing.gguf: no such file or folder".replace(str(tmp_path), "<run>"), line
