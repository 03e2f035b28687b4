"""A command does what it says or says why not (issue 39): a preset that declares a sweep, run without -m; a preset
that fine-tunes, run without init_from; Hydra's own errors for natural slips (a group outside the defaults list
without its plus, a config group given a boolean, a comma-separated value without -m). Each gets one line naming
the value and the fix, exit status 2, and nothing written."""

from __future__ import annotations

import logging

import pytest

from helpers import posbench, refused, run_into, snapshot
from posbench.jobs import command


@pytest.mark.parametrize("overrides, message", [
    (["experiment=demo"], "experiment=demo declares a sweep over scheme: run it with -m (posbench train -m "
     "debug=fast experiment=demo data.cache_dir=<cache>), or run one of its jobs with "
     "scheme=<one of sinusoidal,learned,rope,alibi>"),  # (a sweep writes under hydra.sweep.dir, not hydra.run.dir)
    (["experiment=compare", "scheme=alibi"], "experiment=compare declares a sweep over seed: run it with -m "),
    (["experiment=hybrids"], "experiment=hybrids declares a sweep over +hybrid: run it with -m "),
    (["experiment=extend"], "experiment=extend fine-tunes a trained run: give it one with init_from=<run folder or "
     "its checkpoint.pt>, e.g. posbench train -m experiment=extend init_from=outputs/rope128"),
    (["-m", "experiment=extend"], "experiment=extend fine-tunes a trained run: "),
    (["extend=yarn"], "extend=yarn: extend is not in the defaults list; add it with a plus: +extend=yarn"),
    (["hybrid=irope_wL4"], "hybrid=irope_wL4: hybrid is not in the defaults list; add it with a plus: +hybrid=irope_wL4"),
    (["debug=true"], "debug=true: debug is a config group; choose one of its options: fast"),
    (["model=1"], "model=1: model is a config group; choose one of its options: base, small, tiny"),
    (["scheme=true"], "scheme=true: scheme is a config group; choose one of its options: alibi, cope, fire, "),
    (["scheme=alibi,rope"], "scheme=alibi,rope: a sweep value, which runs with -m: posbench train -m "
     "debug=fast scheme=alibi,rope data.cache_dir=<cache>"),
    (["seed=0,1"], "seed=0,1: a sweep value, which runs with -m: "),
    (["seed=range(0,3)"], "seed=range(0,3): a sweep value, which runs with -m: posbench train -m debug=fast "
     "'seed=range(0,3)' "),  # (quoted for the shell, as every suggested command)
    (["eval.probes=passkey,context"], "eval.probes=passkey,context: eval.probes takes a list, written in brackets "
     "(quoted, for the shell): 'eval.probes=[passkey,context]'; without -m a comma-separated value is a sweep"),
    (["shceme=rope"], "unknown config key 'shceme'; did you mean scheme? see the keys with: posbench train --cfg job"),
    (["train.stpes=2"], "unknown config key 'train.stpes'; did you mean train.steps? see the keys with: "),
    (["scheme.bse=5"], "scheme.bse is not an option of the rope scheme; did you mean scheme.base? its options: base, "),
    (["extend@pkg=yarn"], "extend@pkg=yarn: posbench's config groups take no package (@pkg); write extend=yarn"),
    (["+debug@foo=fast"], "+debug@foo=fast: posbench's config groups take no package (@foo); write +debug=fast"),
    (["hydra/launcher@x=joblib"], "hydra/launcher@x=joblib: posbench's config groups take no package (@x); write "
     "hydra/launcher=joblib"),
    (["~scheme"], "~scheme: scheme cannot be removed from the defaults list; choose one of its options: alibi, cope, "),
    (["~model"], "~model: model cannot be removed from the defaults list; choose one of its options: base, small, tiny"),
    (["+model=small"], "+model=small: model is already in the defaults list; drop the plus: model=small"),
    (["+train.steps=2"], "+train.steps=2: train.steps is already a key; drop the plus: train.steps=2"),
    (["train.steps=[1"], "train.steps=[1: Hydra cannot read this override (no viable alternative at input '[1'); write "
     "key=value, a list in brackets and quoted for the shell: 'key=[a,b]'"),
    (["=rope"], "=rope: an override needs a key before '=': key=value"),
    (["experiment=demo", "eval.lengths=[32,64]", "hydra.launcher.n_jobs=1"], "experiment=demo declares a sweep over "
     "scheme: run it with -m (posbench train -m debug=fast experiment=demo 'eval.lengths=[32,64]' "
     "data.cache_dir=<cache> hydra.launcher.n_jobs=1)"),  # the command as given, hydra.run.dir aside
])
def test_a_slip_gets_one_line_with_its_fix(posbench_here, data_cache, tmp_path, overrides, message):
    run = tmp_path / "run"
    before = snapshot(tmp_path)
    got = refused(run_into(posbench_here, data_cache, run, *overrides), tmp_path, before)
    got = got.replace(str(data_cache), "<cache>").replace(str(tmp_path), "")
    assert got.replace("<run>/run", "<run>").startswith(message), got


@pytest.mark.parametrize("overrides", [
    ["experiment=demo", "scheme=alibi"],  # every swept key picked: one job of the sweep
    ["experiment=compare", "scheme=rope", "seed=1"],
    ["+hybrid=irope_wL4"],  # a hybrid design is a plain preset: no sweep
    ["'eval.lengths=[32,64]'".strip("'")],  # a list is not a sweep
])
def test_a_single_job_of_a_preset_still_runs(posbench_here, data_cache, tmp_path, overrides):
    proc = run_into(posbench_here, data_cache, tmp_path / "run", *overrides)
    assert proc.returncode == 0, proc.stderr


def test_a_slip_is_refused_by_the_command_too(tmp_path):
    """The process-level contract, once: `posbench train experiment=demo` exits 2 with one line and makes no folder."""
    before = snapshot(tmp_path)
    proc = posbench("train", "experiment=demo", cwd=tmp_path)
    assert refused(proc, tmp_path, before).startswith("experiment=demo declares a sweep over scheme: run it with -m")


# ---- posbench eval in the vocabulary of train and report --------------------------------------------------------


@pytest.mark.parametrize("form", ["folder", "checkpoint", "run=checkpoint"])
def test_eval_takes_the_run_as_report_and_init_from_take_it(form, trained_run, posbench_here):
    """A run folder as an argument (as posbench report takes folders), its checkpoint.pt (as init_from takes it), and
    train's names for the device and the threads."""
    arg = {"folder": trained_run, "checkpoint": trained_run / "checkpoint.pt",
           "run=checkpoint": f"run={trained_run / 'checkpoint.pt'}"}[form]
    proc = posbench_here("eval", arg, "train.threads=1", "train.device=cpu")
    assert proc.returncode == 0, proc.stderr
    (job,) = command.PREPARED.values()
    assert (job.run_dir, job.device, job.threads) == (trained_run, "cpu", 1)


def test_eval_takes_hydras_info_flag_and_one_run(trained_run, posbench_here):
    assert posbench_here("eval", f"run={trained_run}", "--info", "defaults").returncode == 0  # (its value: not a run)
    before = snapshot(trained_run)
    assert refused(posbench_here("eval", trained_run, trained_run), trained_run, before) == (
        "run=<run> run=<run>: posbench eval evaluates one run; for several, sweep them: posbench eval -m run=<run>,<run>")


@pytest.mark.parametrize("args, message", [
    (["no-such-folder"], "no-such-folder: not a run folder; posbench eval takes the run as run=<run folder> (or its "
     "folder alone) and its options as key=value, e.g. posbench eval run=outputs/…_alibi eval.protocol=sliding"),
    (["run=RUN", "eval.foo=1"], "unknown config key 'eval.foo'; see the keys with: posbench eval run=<run folder> --cfg job"),
    (["run=RUN", "foo=1"], "unknown config key 'foo'; see the keys with: posbench eval run=<run folder> --cfg job"),
    (["run=RUN", "eval.lenghts=[64]"], "unknown config key 'eval.lenghts'; did you mean eval.lengths? see the keys with: "
     "posbench eval run=<run folder> --cfg job"),
    (["run=RUN", "eval_experiment=remaps"], "eval_experiment=remaps declares a sweep over eval.remap, model.attn_scale: "
     "run it with -m (posbench eval -m run=<run> eval_experiment=remaps), or run one of its jobs with eval.remap=<one of "
     "none,streaming,lm_infinite,rerope,leaky_rerope,self_extend,dca> model.attn_scale=<one of none,log_n_clipped>"),
])
def test_eval_hints_name_eval(args, message, trained_run, posbench_here, tmp_path):
    before = snapshot(trained_run)
    proc = posbench_here("eval", *[a.replace("RUN", str(trained_run)) for a in args])
    assert refused(proc, trained_run, before) == message


# ---- an option that means nothing without another ----------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["data.passkey_pairs=4"], "data.passkey_pairs=4 does nothing without needles in the training windows: add "
     "data.passkey_rate=<fraction>, or drop it"),
    (["data.copy_until=0.3"], "data.copy_until=0.3 does nothing without copy windows in the training windows: add "
     "data.copy_rate=<fraction>, or drop it"),
    (["eval.passkey.trials=5"], "eval.passkey.trials=5 does nothing without its probe: add 'eval.probes=[passkey]', "
     "or drop it"),
    (["eval.passkey.lengths=[32]", "eval.probes=[context]"], "eval.passkey.lengths=[32] does nothing without its "
     "probe: add 'eval.probes=[passkey]', or drop it"),
    (["eval.context.stride=8"], "eval.context.stride=8 does nothing without its probe: add 'eval.probes=[context]', "
     "or drop it"),
    (["data.passkey_rate=0.5", "eval.passkey.trials=5", "train.seq_len=64", "eval.lengths=[64]"],
     "eval.passkey.trials=5 does nothing without its probe: add 'eval.probes=[passkey]', or drop it"),
])
def test_an_option_without_the_one_it_acts_through_is_refused(posbench_here, data_cache, tmp_path, overrides, message):
    before = snapshot(tmp_path)
    assert refused(run_into(posbench_here, data_cache, tmp_path / "run", *overrides), tmp_path, before) == message


@pytest.mark.parametrize("overrides", [
    ["data.passkey_rate=0.5", "data.passkey_pairs=2", "train.seq_len=64", "eval.lengths=[64]"],
    ["data.copy_rate=0.5", "data.copy_until=0.3"],
    ["eval.probes=[passkey]", "eval.passkey.trials=5"],
    ["eval.probes=[context]", "eval.context.stride=8"],
    ["data.passkey_pairs=1", "data.copy_until=0.5"],  # the defaults, said again: nothing to refuse
    ["data.passkey_rate=0.5", "eval.passkey.keys=frequent", "train.seq_len=64", "eval.lengths=[64]"],  # the training
])                                                                           # needles' format, without the probe
def test_with_what_it_acts_through_it_runs(posbench_here, data_cache, tmp_path, overrides):
    proc = run_into(posbench_here, data_cache, tmp_path / "run", *overrides)
    assert proc.returncode == 0, proc.stderr


def test_eval_refuses_a_probes_options_without_the_probe(trained_run, posbench_here):
    before = snapshot(trained_run)
    proc = posbench_here("eval", f"run={trained_run}", "eval.context.stride=2")  # (4 = L // 8: the default, said again)
    assert refused(proc, trained_run, before) == ("eval.context.stride=2 does nothing without its probe: add "
                                                  "'eval.probes=[context]', or drop it")


# ---- the start of a run says what is on -------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, said", [
    ([], ["on: fp32 training"]),
    (["train.seq_len=64", "eval.lengths=[64]", "data.passkey_rate=0.5", "data.passkey_pairs=2", "data.copy_rate=0.3",
      "data.copy_until=0.2", "model.attn_scale=ssmax", "train.lr=0.001", "train.schedule=constant", "eval.probe_every=2",
      "eval.probes=[passkey]", "eval.passkey.lengths=[64]", "eval.passkey.trials=1"],
     ["on: fp32 training, train.lr=0.001", "train.schedule=constant", "data.passkey_rate=0.5", "data.passkey_pairs=2",
      "data.copy_rate=0.3", "data.copy_until=0.2", "model.attn_scale=ssmax", "eval.probe_every=2"]),
    (["model.dropout=0.1", "train.weight_decay=0.0"], ["on: fp32 training", "train.weight_decay=0.0", "model.dropout=0.1"]),
])
def test_the_start_of_a_run_says_what_is_on(overrides, said, data_cache, tmp_path, torch_state, caplog):
    """The curricula, the precision, the attention scale and every other option set away from its default that
    changes training, in the run's log before its first step; a default run says only its precision (and here
    debug=fast's warmup)."""
    from helpers import train_here

    with caplog.at_level(logging.INFO, logger="posbench"):
        train_here(data_cache, tmp_path / "run", "train.steps=2", *overrides)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("on: ")]
    assert all(s in line for s in said), line
    if not overrides:
        assert line == "on: fp32 training, train.warmup_steps=1"  # debug=fast's warmup


def test_the_start_of_a_run_names_the_corpus_once(data_cache):
    """A corpus other than the default (data=wikitext103: its name and vocabulary size away from the schema's) is named
    by the run's first log line (its cache folder, name-key, and its vocabulary), not repeated on the ``on:`` line."""
    from helpers import compose_train
    from posbench.config.schema import finalize, training_options

    cfg = compose_train(data_cache, "data=wikitext103", "data.max_train_tokens=1000")
    finalize(cfg)
    assert (cfg.data.name, cfg.data.vocab_size) == ("wikitext103", 16384)  # both away from the default corpus's
    assert [o for o in training_options(cfg) if o.startswith("data.")] == ["data.max_train_tokens=1000"]


def test_version_and_an_aligned_help(posbench_here):
    from importlib.metadata import version

    assert posbench_here("--version").stdout == f"posbench {version('posbench')}\n"
    lines = [line for line in posbench_here("--help").stdout.splitlines() if line.startswith(("  train", "  eval", "  report"))]
    assert len(lines) == 3 and len({line.index(" posbench ") for line in lines}) == 1, lines  # the examples in one column
