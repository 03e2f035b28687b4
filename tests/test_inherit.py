"""What a run started from a parent (``init_from``) takes from it, in process: the parent's scheme, its options
and its L put into Hydra's composition (``posbench.jobs.command.inherit``), and what still wins over them; the options
that differ from the parent's (``posbench.training.lineage.differences``); what preparing a job logs, held and logged when
the job starts (``posbench.jobs.command.held_logs``, ``job_for``).

Parents here are checkpoint contents made by hand (``posbench.training.lineage.read`` is replaced); tests/test_init_from.py
runs the same through the CLI on trained parents.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore

from posbench.cli import register
from posbench.config.checks import ConfigError
from posbench.jobs import command
from posbench.training import lineage

ROPE = {"name": "rope", "base": 500.0, "scaling": "none", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_length": None, "yarn_ramp": "reference", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "rotary_fraction": 0.5}


def parent(scheme: dict, seq_len: int) -> lineage.Parent:
    return lineage.Parent(Path("/runs/p/checkpoint.pt"), {"config": {"train": {"seq_len": seq_len}},
                                                          "spec": {"scheme": scheme}})


@pytest.fixture
def parents(monkeypatch):
    """``init_from=<name>`` reads ``found[name]``; the parent options stored in Hydra's ConfigStore are removed after."""
    found = {"learned48": parent({"name": "learned", "max_positions": 96}, 48), "rope64": parent(ROPE, 64),
             "rope64b": parent(ROPE, 64), "rope32": parent(ROPE, 32)}
    monkeypatch.setattr(lineage, "read", lambda path: found[path])
    register()
    yield found
    command.inherit([])  # (removes them)
    assert "parent" not in ConfigStore.instance().repo


def composed(*overrides: str):
    command.inherit(list(overrides))
    with initialize_config_module(command.CONFIG_MODULE, version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_a_child_composes_with_the_parents_scheme_options_and_length(parents):
    cfg = composed("init_from=learned48")
    assert dict(cfg.scheme) == {"name": "learned", "max_positions": 96} and cfg.train.seq_len == 48
    cfg = composed("init_from=learned48", "scheme.max_positions=256")  # an option of the parent's scheme composes
    assert cfg.scheme.max_positions == 256 and cfg.train.seq_len == 48
    assert dict(composed("init_from=rope64").scheme) == ROPE  # every option, not only those left unset


@pytest.mark.parametrize("overrides, scheme, seq_len", [
    (["scheme=alibi"], "alibi", 64),  # the command line's scheme (refused later, by lineage.check_config)
    (["scheme=rope"], {**ROPE, "base": 10000.0, "rotary_fraction": 1.0}, 64),  # a scheme given by name: its defaults
    (["train.seq_len=100"], ROPE, 100),
    (["+extend=longer"], ROPE, 128),  # a preset's L
    (["+tricks=alibi_plain"], "alibi", 64),  # a preset's scheme
    (["experiment=extend"], {**ROPE, "scaling": "none"}, 512),
    (["debug=fast"], ROPE, 32),  # debug=fast's short L (conf/debug/lengths/of_fast.yaml)
])
def test_the_command_line_and_presets_win_over_the_parent(parents, overrides, scheme, seq_len):
    cfg = composed("init_from=rope64", *overrides)
    assert (cfg.scheme.name if isinstance(scheme, str) else dict(cfg.scheme)) == scheme
    assert cfg.train.seq_len == seq_len


def test_without_a_parent_the_defaults_are_trains(parents):
    cfg = composed("init_from=null")
    assert cfg.scheme.name == "rope" and cfg.scheme.rotary_fraction == 1.0 and cfg.train.seq_len == 128
    assert "parent" not in ConfigStore.instance().repo


def test_a_sweep_over_parents_takes_what_they_share_and_refuses_what_they_do_not(parents):
    command.inherit(["init_from=rope64,rope64b"])  # two parents, the same scheme, options and L
    assert ConfigStore.instance().repo["parent"]
    with pytest.raises(ConfigError, match=r"init_from=rope64,rope32: a run takes its parent's scheme, scheme options, "
                                          r"L and layers, and these parents differ \(.*train.seq_len=64; .*train.seq_len=32\)"):
        command.inherit(["init_from=rope64,rope32"])


def test_a_parent_of_a_scheme_no_longer_registered_is_refused(parents):
    parents["gone"] = parent({"name": "gone"}, 32)
    with pytest.raises(ConfigError, match=r"its scheme 'gone' is not registered; the schemes: .*rope"):
        command.inherit(["init_from=gone"])


def test_differences_lists_what_the_child_changed_in_its_order():
    before = {"init_from": None, "seed": 0, "train": {"seq_len": 32, "steps": 4, "lr": 2e-3},
              "eval": {"lengths": [32, 64], "probes": [], "passkey": {"lengths": [32, 64]}, "context": {"stride": 4}},
              "scheme": {"name": "rope", "scaling": "none"}}
    after = {"init_from": "/runs/p", "seed": 0, "train": {"seq_len": 64, "steps": 0, "lr": 2e-3, "new_key": 1},
             "eval": {"lengths": [64], "probes": [], "passkey": {"lengths": [64]}, "context": {"stride": 8}},
             "scheme": {"name": "rope", "scaling": "yarn"}}
    assert lineage.differences(before, after) == ["train.seq_len: 32 → 64", "train.steps: 4 → 0",
                                                  "eval.lengths: [32, 64] → [64]", "scheme.scaling: none → yarn"]
    after["eval"]["probes"] = ["passkey"]  # a probe that runs: its options count
    assert "eval.passkey.lengths: [32, 64] → [64]" in lineage.differences(before, after)
    assert lineage.differences(before, before) == []


def test_what_preparing_logs_is_held_and_logged_when_the_job_starts(caplog, monkeypatch):
    log = logging.getLogger("posbench")
    with caplog.at_level(logging.INFO, logger="posbench"):
        level = log.level
        with command.held_logs() as held:
            log.warning("a warning while preparing")
            log.info("a note while preparing")
        assert caplog.records == [] and [r.getMessage() for r in held] == ["a warning while preparing",
                                                                            "a note while preparing"]
        assert log.propagate and log.level == level and not log.handlers  # put back
        cfg = {"a": 1}
        monkeypatch.setattr(command, "key_of", lambda c: "key")
        monkeypatch.setitem(command.PREPARED, "key", "the job")
        monkeypatch.setitem(command.HELD, "key", held)
        assert command.job_for(cfg, lambda c: pytest.fail("prepared again")) == "the job"
        assert [r.getMessage() for r in caplog.records] == ["a warning while preparing", "a note while preparing"]
        assert command.job_for(cfg, None) == "the job" and len(caplog.records) == 2  # logged once
