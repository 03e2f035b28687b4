"""Names that tell runs apart: a run folder and a sweep's job folder are named by the run's label
(``${posbench_label:}``: posbench/config/resolvers.py), not by the base scheme alone; and one evaluation has one label
on the console, in its eval file's name and in the report (``posbench.evaluation.results.evaluation_label``)."""

from __future__ import annotations

import re

import pytest
from hydra import compose, initialize_config_module
from omegaconf import open_dict

from posbench.cli import register
from posbench.report import render


@pytest.mark.parametrize("overrides, name", [
    ([], "rope"),
    (["scheme=alibi"], "alibi"),
    (["+hybrid=irope_wL4"], "rope+LLLG_c8_G-nope_qknorm0-L"),  # (a hybrid landed in …_rope before)
    (["model.attn_scale=log_n"], "rope+log_n"),
    (["scheme.scaling=yarn", "scheme.factor=4"], "rope+yarnx4"),
])
def test_a_run_folder_and_a_sweeps_job_folder_are_named_by_the_runs_label(overrides, name):
    register()
    with initialize_config_module("posbench.conf", version_base="1.3"):
        cfg = compose("train", overrides=["debug=fast", "seed=2", *overrides], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.job.num = 3
    assert re.fullmatch(rf"outputs/\d{{4}}-\d\d-\d\d/\d\d-\d\d-\d\d_{re.escape(name)}", cfg.hydra.run.dir), cfg.hydra.run.dir
    assert cfg.hydra.sweep.subdir == f"3_{name}_seed2"


def test_one_evaluation_has_one_label_on_the_console_in_its_file_name_and_in_the_report(existing_run, run_cli):
    """A re-evaluation with a zero-shot temperature and a remap: the console's "evaluating …" line, the eval file's
    name (the label with brackets and spaces as underscores) and the report's row say the same label."""
    label = "rope@rerope(w4) (floor_log at eval)"
    proc = run_cli("eval", f"run={existing_run}", "eval.remap=rerope", "eval.remap_options.window=4",
                   "model.attn_scale=floor_log", "eval.lengths=[32,64]", "eval.max_tokens=256")
    assert proc.returncode == 0, proc.stderr
    assert f"evaluating {label} ({existing_run})" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert [p.name for p in existing_run.glob("eval-*.json")] == [
        "eval-rope@rerope_w4_floor_log_at_eval-nonoverlapping-validation-1.json"]
    table, rows, _ = render.write_report([existing_run], existing_run / "report")
    assert label in {r["label"] for r in rows}, sorted({r["label"] for r in rows})
