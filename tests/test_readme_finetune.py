"""The README's fine-tuning example, run as written (issue 39 item 4): its parent and the fine-tune at tiny size (4
steps, 4096 tokens scored per length), then ``posbench report`` over both. The report puts the fine-tuned run in the
parent's table (the same evaluation lengths: a fine-tune evaluates at its parent's lengths unless given others) and
writes ``ppl_vs_finetune.png``; a fine-tune given its own lengths, or whose L its parent's lengths do not reach, keeps
L … 16L of its own L.
"""

from __future__ import annotations

import csv
import json
import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers import ok
from posbench.config.schema import EvalConfig
from posbench.report import compare
from posbench.report.records import collect
from posbench.training import lineage

README = Path(__file__).resolve().parents[1] / "README.md"
TINY = ["train.steps=4", "eval.max_tokens=4096", "train.threads=1", "wandb.enabled=false"]  # after the README's: they win


def readme_command(marker: str) -> list[str]:
    """The arguments after ``posbench`` of the README's command line holding ``marker`` (continuation lines joined,
    the trailing comment dropped), as a shell would split them."""
    text = README.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("posbench ") and marker in line)
    return shlex.split(line.split(" # ")[0])[1:]


def lengths_of(run: Path) -> list[int]:
    return json.loads((run / "results.json").read_text())["lengths"]


@pytest.fixture(scope="module")
def parent_and_finetune(run_cli, data_cache, tmp_path_factory):
    """(cwd, parent folder, fine-tuned folder): the README's parent (``posbench train scheme=rope``) trained into the
    folder its fine-tuning line names, then that line run as written, both at tiny size."""
    args = readme_command("init_from=")
    parent = next(a.split("=", 1)[1] for a in args if a.startswith("init_from="))
    cwd = tmp_path_factory.mktemp("readme")
    cache = f"data.cache_dir={data_cache}"
    ok(run_cli("train", "scheme=rope", *TINY, cache, f"hydra.run.dir={parent}", cwd=cwd))
    ok(run_cli(*args, *TINY, cache, "hydra.run.dir=outputs/finetuned", cwd=cwd))
    return cwd, cwd / parent, cwd / "outputs/finetuned"


def test_readme_finetune_is_evaluated_at_its_parents_lengths(parent_and_finetune):
    _, parent, finetuned = parent_and_finetune
    assert lengths_of(parent) == [128, 256, 512, 1024, 2048]
    assert lengths_of(finetuned) == lengths_of(parent)
    assert json.loads((finetuned / "results.json").read_text())["config"]["train"]["seq_len"] == 512


def test_readme_finetune_report_puts_it_beside_its_parent(parent_and_finetune, run_cli):
    cwd, parent, finetuned = parent_and_finetune
    out = cwd / "report"
    ok(run_cli("report", parent, finetuned, "--out", out, cwd=cwd))
    text = (out / "report.md").read_text()
    assert len(re.findall(r"^### \d+\. ", text, re.M)) == 1, text
    rows = [line.split("|")[1].strip() for line in text.splitlines() if re.match(r"\| rope", line)]
    assert rows[:2] == ["rope", "rope+yarn×4 ft512×4"], rows
    assert (out / "ppl_vs_finetune.png").stat().st_size > 0
    rows = list(csv.DictReader((out / "report.csv").open()))
    parent_ppl = next(float(r["ppl"]) for r in rows if r["label"] == "rope" and r["length"] == "2048")
    folded = compare.fold(collect([parent, finetuned])[0])
    assert compare.finetune_parents(folded) == {"rope": pytest.approx(parent_ppl, rel=1e-6)}  # its dotted line


def test_finetune_keeps_given_lengths_and_its_own_past_the_parents(parent_and_finetune, run_cli, data_cache):
    cwd, parent, _ = parent_and_finetune
    cache = f"data.cache_dir={data_cache}"
    given = cwd / "outputs/given"
    ok(run_cli("train", f"init_from={parent}", "train.seq_len=256", "eval.lengths=[256,512]", *TINY, cache,
               f"hydra.run.dir={given}", cwd=cwd))
    assert lengths_of(given) == [256, 512]
    short = cwd / "outputs/short"  # a parent evaluated at its L only: a fine-tune at 2L takes L … 16L of its own
    ok(run_cli("train", "scheme=rope", "eval.lengths=[128]", *TINY, cache, f"hydra.run.dir={short}", cwd=cwd))
    beyond = cwd / "outputs/beyond"
    ok(run_cli("train", f"init_from={short}", "train.seq_len=256", "train.steps=0", "eval.max_tokens=4096",
               "wandb.enabled=false", cache, f"hydra.run.dir={beyond}", cwd=cwd))
    assert lengths_of(beyond) == [256 * 2 ** k for k in range(5)]


@pytest.mark.parametrize("L, protocol, stride, probes, context_stride, fits", [
    (512, "nonoverlapping", None, [], None, True),  # 1024 and 2048 past L
    (2048, "nonoverlapping", None, [], None, False),  # none past L: its own L … 16L
    (512, "sliding", 64, [], None, True),
    (512, "sliding", 256, [], None, False),  # a stride past the shortest length, 128
    (512, "nonoverlapping", None, ["context"], None, True),  # L // 8 = 64 divides 512 and 1536
    (384, "nonoverlapping", None, ["context"], None, False),  # 48 does not divide 2048 − 384 = 1664
    (384, "nonoverlapping", None, ["context"], 128, True),  # 128 divides 128, 640 and 1664
])
def test_a_parents_lengths_are_taken_only_where_they_fit(L, protocol, stride, probes, context_stride, fits):
    given = {"protocol": protocol, "stride": stride, "probes": probes, "context": {"stride": context_stride}}
    cfg = OmegaConf.create({"train": {"seq_len": L}, "eval": OmegaConf.merge(OmegaConf.structured(EvalConfig), given)})
    assert lineage._fit(cfg, [128, 256, 512, 1024, 2048]) is fits
