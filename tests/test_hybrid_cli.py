"""Hybrid layers, windows, sinks and PoSE from the command line: the values refused before anything is written, the
presets (``experiment=hybrids``, ``experiment=hybrids_retrieval``, conf/hybrid/), a hybrid run trained, re-evaluated,
fine-tuned and reported, and records from before the options.

Refusals follow tests/test_refusals.py: exit status 2, one line naming the value and what is allowed, the run folder
untouched (checked in this process through conftest's ``posbench_here``; one of them as a process of its own).
"""

from __future__ import annotations

import json
import re

import pytest
from hydra import compose, initialize_config_module

from helpers import compose_train, eval_here, kept_torch_state, ok, refused, run_into, snapshot, train_here
from posbench.cli import register
from posbench.config.schema import finalize, to_dict
from posbench.evaluation.results import run_label

HYBRID = ["model.layer_pattern=LG", "model.window=8", "model.global_scheme=nope"]  # debug=fast: L = 32

BAD = {  # id: (overrides, regexes the message must all hold)
    "unknown-letter": (["model.layer_pattern=LXG"], [r"model\.layer_pattern='LXG'", r"\bL\b.*\bG\b", "'X'"]),
    "empty-pattern": (["model.layer_pattern=''"], [r"model\.layer_pattern=''"]),
    "window-without-L-layer": (["model.window=8"], [r"model\.window=8", r"L layers", r"layer_pattern=G"]),
    "window-below-1": (["model.layer_pattern=LG", "model.window=0"], [r"model\.window=0", "positive"]),
    "window-above-L": (["model.layer_pattern=LG", "model.window=33"], [r"model\.window=33", r"train\.seq_len=32",
                                                                        r"< 32"]),
    "window-of-L": (["model.layer_pattern=LG", "model.window=32"], [r"model\.window=32", "hides no key"]),
    "window-and-attn-scale": ([*HYBRID, "model.attn_scale=log_n"], [r"model\.attn_scale=log_n", r"model\.window=8"]),
    "kind-without-window": (["model.window_kind=chunked"], [r"model\.window_kind=chunked", r"model\.window="]),
    "unknown-kind": (["model.layer_pattern=LG", "model.window=8", "model.window_kind=strided"],
                     [r"model\.window_kind='strided'", "sliding, chunked"]),
    "pattern-that-changes-nothing": (["model.layer_pattern=LLLG"], [r"model\.layer_pattern=LLLG", r"model\.window",
                                                                     r"model\.global_scheme"]),
    "global-scheme-without-G-layer": (["model.layer_pattern=L", "model.window=8", "model.global_scheme=nope"],
                                      [r"model\.global_scheme=nope", "no G layer"]),
    "global-scheme-without-L-layer": (["model.global_scheme=nope"], [r"model\.global_scheme=nope", "no L layer",
                                                                      "scheme=nope"]),
    "global-scheme-unknown": (["model.layer_pattern=LG", "model.global_scheme=ropes"], [r"'ropes'", "rope"]),
    "global-scheme-unknown-option": (["model.layer_pattern=LG", "model.global_scheme={name:rope,bases:5}"],
                                     [r"model\.global_scheme\.bases=5", "base"]),
    "global-scheme-bad-value": (["model.layer_pattern=LG", "model.global_scheme={name:rope,base:-1}"],
                                [r"model\.global_scheme\.base=-1"]),
    "global-scheme-embeds": (["model.layer_pattern=LG", "model.window=8", "model.global_scheme=learned"],
                             [r"model\.global_scheme=learned", "embeddings"]),
    "local-scheme-embeds": (["scheme=sinusoidal", *HYBRID], [r"scheme=sinusoidal", "embeddings"]),
    "qk-layers-without-qk-norm": (["model.qk_norm_layers=local"], [r"model\.qk_norm_layers=local", "qk_norm=rms"]),
    "qk-weight-without-qk-norm": (["model.qk_norm_weight=false"], [r"model\.qk_norm_weight=False", "qk_norm=rms"]),
    "qk-local-without-L-layer": (["model.qk_norm=rms", "model.qk_norm_layers=local"],
                                 [r"model\.qk_norm_layers=local", "L layers"]),
    "pose-below-L": (["train.pose=16"], [r"train\.pose=16", r"train\.seq_len=32"]),
    "pose-for-nope": (["scheme=nope", "train.pose=512"], [r"train\.pose=512", "scheme=nope", "no positions"]),
    "pose-for-nope-hybrid": (["scheme=nope", "model.layer_pattern=LG", "model.window=8", "model.global_scheme=nope",
                              "train.pose=512"], [r"train\.pose=512", "global_scheme=nope"]),
    "pose-and-random-positions": (["train.pose=512", "train.random_positions=512"],
                                  [r"train\.random_positions=512", r"train\.pose=512", "one of them"]),
    "pose-chunks-without-pose": (["train.pose_chunks=3"], [r"train\.pose_chunks=3", r"train\.pose="]),
    "pose-one-chunk": (["train.pose=512", "train.pose_chunks=1"], [r"train\.pose_chunks=1", "2…32"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_layer_or_position_value_is_refused_and_the_run_folder_untouched(case, posbench_here, data_cache,
                                                                             existing_run):
    overrides, checks = BAD[case]
    before = snapshot(existing_run)
    message = refused(run_into(posbench_here, data_cache, existing_run, *overrides), existing_run, before)
    for check in checks:
        assert re.search(check, message), f"{check!r} not in {message!r}"


def test_a_refusal_in_its_own_process_is_one_line(run_cli, data_cache, existing_run):
    before = snapshot(existing_run)
    message = refused(run_into(run_cli, data_cache, existing_run, "model.layer_pattern=LXG"), existing_run, before)
    assert message.startswith("model.layer_pattern='LXG'")


def test_good_neighbours_pass(data_cache):
    """Each value next to a refused one is accepted: W = L − 1, a chunked window, every pattern letter, a global scheme
    by name or as a section, QK-norm's options with it, PoSE with N = L chunks."""
    for overrides in (["model.layer_pattern=LG", "model.window=31"], [*HYBRID, "model.window_kind=chunked"],
                      ["model.layer_pattern=LLLG", "model.global_scheme={name:rope,base:1000000.0}"],
                      ["model.qk_norm=rms", "model.qk_norm_weight=false"],
                      ["model.layer_pattern=GL", "model.qk_norm=rms", "model.qk_norm_layers=local"],
                      ["train.pose=512", "train.pose_chunks=32"], ["model.attn_sink=true"]):
        finalize(compose_train(data_cache, *overrides), training=False)


def test_the_global_scheme_is_resolved_as_a_scheme_section(data_cache):
    cfg = finalize(compose_train(data_cache, "model.layer_pattern=LG", "model.global_scheme=rope",
                                 "scheme.base=500"), training=False)
    g = to_dict(cfg)["model"]["global_scheme"]
    assert g["name"] == "rope" and g["base"] == 10000.0 and g["scaling"] == "none"  # its own defaults, not scheme's
    assert to_dict(cfg)["scheme"]["base"] == 500


# ---- the presets ----------------------------------------------------------------------------------------------

LABELS = {  # design → (label at 4 layers, expanded pattern)
    "rope": ("rope", "GGGG"), "nope": ("nope", "GGGG"), "alibi": ("alibi", "GGGG"),
    "irope_wL4": ("rope+LLLG(c32, G=nope, qknorm0-L)", "LLLG"), "irope_wL2": ("rope+LLLG(c64, G=nope, qknorm0-L)", "LLLG"),
    "rnope_swa_wL4": ("rope+LLLG(w32, G=nope)", "LLLG"), "rnope_swa_wL2": ("rope+LLLG(w64, G=nope)", "LLLG"),
    "local_global_wL4": ("rope+LLLG(w32, G=rope[base=1e+06], qknorm)", "LLLG"),
    "local_global_wL2": ("rope+LLLG(w64, G=rope[base=1e+06], qknorm)", "LLLG"),
    "smollm3": ("rope+LLLG(G=nope)", "LLLG"), "gptoss_wL4": ("rope+LG(w32, sink)", "LGLG"),
    "gptoss_wL2": ("rope+LG(w64, sink)", "LGLG"), "rope_pose": ("rope+pose2048", "GGGG"),
}


def sweep(experiment: str) -> list[str]:
    register()
    with initialize_config_module("posbench.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}"], return_hydra_config=True)
    return str(cfg.hydra.sweeper.params["+hybrid"]).split(",")


def test_experiment_hybrids_sweeps_every_design_with_its_label():
    from posbench.attention.windows import expand_pattern

    assert sweep("hybrids") == list(LABELS)
    with initialize_config_module("posbench.conf", version_base="1.3"):
        for design, (label, kinds) in LABELS.items():
            cfg = finalize(compose("train", overrides=["experiment=hybrids", f"+hybrid={design}"]), training=False)
            assert run_label(to_dict(cfg)) == label
            assert expand_pattern(cfg.model.layer_pattern, cfg.model.n_layer) == kinds
            assert cfg.model.n_layer == 4 and cfg.train.seq_len == 128 and list(cfg.eval.probes) == ["context"]
            assert cfg.model.window in (None, 32, 64)


def test_the_designs_follow_the_train_length():
    """W = L/4 and L/2 and PoSE's L_t = 16L are multiples of ``train.seq_len`` (``${posbench_times:…}``): at debug=fast's
    L = 32 every design composes and passes the checks, with W = 8 and 16 and L_t = 512."""
    designs = sweep("hybrids")
    with initialize_config_module("posbench.conf", version_base="1.3"):
        for design in designs:
            cfg = finalize(compose("train", overrides=["experiment=hybrids", f"+hybrid={design}", "debug=fast"]),
                           training=False)
            assert cfg.train.seq_len == 32 and cfg.model.window in (None, 8, 16)
            assert cfg.train.pose in (None, 512)


def test_experiment_hybrids_retrieval_takes_the_retrieval_recipe_at_two_layers():
    designs = sweep("hybrids_retrieval")
    with initialize_config_module("posbench.conf", version_base="1.3"):
        recipe = to_dict(finalize(compose("train", overrides=["experiment=retrieval"]), training=False))
        for design in designs:
            cfg = to_dict(finalize(compose("train", overrides=["experiment=hybrids_retrieval", f"+hybrid={design}"]),
                                   training=False))
            assert cfg["model"]["n_layer"] == 2 and cfg["train"]["steps"] == 24000
            assert {k: cfg[k] for k in ("data", "eval")} == {k: recipe[k] for k in ("data", "eval")}
            pattern = cfg["model"]["layer_pattern"]
            assert pattern in ("G", "LG"), f"{design}: {pattern} at two layers"
            if design.endswith(("_lg", "wL2")):
                assert pattern == "LG"


def test_experiment_retrieval_keeps_its_recipe_and_sweep():
    register()
    with initialize_config_module("posbench.conf", version_base="1.3"):
        cfg = compose("train", overrides=["experiment=retrieval"], return_hydra_config=True)
    assert cfg.hydra.sweeper.params.scheme == "sinusoidal,learned,rope,alibi,nope,t5,kerple_log"
    assert cfg.model.n_layer == 2 and cfg.train.batch_size == 4 and cfg.train.steps == 24000
    assert cfg.data.passkey_pairs == 4 and list(cfg.eval.probes) == ["passkey", "context"] and cfg.eval.probe_every == 1000


# ---- a hybrid run: trained, re-evaluated, fine-tuned, reported ------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_run(data_cache, tmp_path_factory):
    run = tmp_path_factory.mktemp("hybrid") / "run"
    with kept_torch_state():
        rec = train_here(data_cache, run, *HYBRID, "model.attn_sink=true", "model.qk_norm=rms")  # lengths 32, 64
    return run, rec


def test_a_hybrid_run_records_its_layers_and_label(hybrid_run):
    run, rec = hybrid_run
    assert rec["label"] == "rope+LG(w8, G=nope, qknorm, sink)"
    model = json.loads((run / "results.json").read_text())["config"]["model"]
    assert model["layer_pattern"] == "LG" and model["window"] == 8 and model["global_scheme"] == {"name": "nope"}
    assert all(r["ppl"] > 1 for r in rec["results"])


def test_posbench_eval_rebuilds_the_hybrid(hybrid_run, torch_state):
    run, rec = hybrid_run
    again = eval_here(f"run={run}", "eval.lengths=[32,64]", "eval.max_tokens=256")
    assert again["label"] == rec["label"]
    assert [r["nll"] for r in again["results"]] == pytest.approx([r["nll"] for r in rec["results"]], rel=1e-6)
    assert any(p.name.startswith("eval-rope+LG_w8_G-nope_qknorm_sink-") for p in run.iterdir())


def test_a_fine_tune_takes_the_parent_s_layers(hybrid_run, data_cache):
    from posbench.jobs import command

    run, _ = hybrid_run
    register()
    try:
        command.inherit([f"init_from={run}"])
        with initialize_config_module("posbench.conf", version_base="1.3"):
            cfg = compose("train", overrides=[f"init_from={run}", "debug=fast", f"data.cache_dir={data_cache}"])
        cfg = to_dict(finalize(cfg, training=False, trained_length=32))
    finally:
        command.inherit([])
    m = cfg["model"]
    assert (m["layer_pattern"], m["window"], m["global_scheme"], m["attn_sink"], m["qk_norm"]) == ("LG", 8, {"name": "nope"},
                                                                                               True, "rms")


def test_a_fine_tune_may_not_change_the_layers(hybrid_run, posbench_here, data_cache, existing_run):
    run, _ = hybrid_run
    before = snapshot(existing_run)
    message = refused(run_into(posbench_here, data_cache, existing_run, f"init_from={run}", "model.window=16",
                               "train.steps=2"), existing_run, before)
    assert "model.window=16" in message and "model.window=8" in message


def test_the_report_labels_the_hybrid_row(hybrid_run, trained_run, tmp_path):
    """The hybrid and a plain RoPE run share a table, each row named by its label: the layer options are in the
    label, not in a legend of settings that differ."""
    from posbench.report.render import write_report

    run, _ = hybrid_run
    out = tmp_path / "report"
    write_report([run, trained_run], out)
    text = (out / "report.md").read_text()
    assert "| rope+LG(w8, G=nope, qknorm, sink) |" in text and "| rope |" in text
    tables = text.split("## Settings held fixed")[0]
    assert "model.window" not in tables and "model.layer_pattern" not in tables


def test_a_record_from_before_the_options_keeps_its_label_and_model():
    """A config without the layer options (every record before them) labels as before and rebuilds the model the
    same: the keys read as their defaults."""
    import torch

    from posbench.config.upgrade import upgrade
    from posbench.model import build

    old = {"scheme": {"name": "rope"}, "model": {"n_layer": 2, "name": "tiny"}, "train": {"seq_len": 128}}
    assert run_label(old) == run_label(upgrade(old)) == "rope"
    torch.manual_seed(0)
    before = build.build_model({"vocab_size": 50, "model": {"n_layer": 2}, "scheme": {"name": "rope"}})
    torch.manual_seed(0)
    now = build.build_model(build.model_spec(old, 50))
    assert before.state_dict().keys() == now.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(before.state_dict().values(), now.state_dict().values()))


def test_the_cli_trains_a_pose_run(run_cli, data_cache, tmp_path):
    run = tmp_path / "pose"
    ok(run_into(run_cli, data_cache, run, "train.pose=512", "eval.lengths=[32]"))
    assert json.loads((run / "results.json").read_text())["label"] == "rope+pose512"
