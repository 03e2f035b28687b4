"""Every config shipped in posbench.conf composes into the schema and passes ``finalize``; the value checks
of ``finalize`` reject what docs/design.md §5 says they reject. In process, through Hydra's compose API.
"""

from __future__ import annotations

import itertools
from importlib.resources import files

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from posbench.cli import register
from posbench.config.checks import ConfigError
from posbench.config.schema import finalize
from posbench.schemes import SCHEMES
from posbench.training.states import changed_keys

CONFIG_MODULE = "posbench.conf"
GROUPS = ("scheme", "model", "data", "experiment", "debug")


def options(group: str) -> list[str]:
    """The option names of a config group: the files of the installed package and, for ``scheme``, the
    registered schemes (``register`` stores one schema per scheme in Hydra's ConfigStore)."""
    found = {p.name[: -len(".yaml")] for p in (files(CONFIG_MODULE) / group).iterdir() if p.name.endswith(".yaml")}
    return sorted(found | (set(SCHEMES) if group == "scheme" else set()))


ALL_OPTIONS = [(g, o) for g in GROUPS for o in options(g)]


@pytest.fixture
def hydra_ctx():
    register()
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        yield


@pytest.fixture
def text_files(tmp_path):
    for name in ("train.txt", "valid.txt"):
        (tmp_path / name).write_text("To be, or not to be, that is the question.\n" * 50)
    return [f"data.train_files=[{tmp_path / 'train.txt'}]", f"data.validation_files=[{tmp_path / 'valid.txt'}]"]


def test_every_group_has_its_options(hydra_ctx):
    from hydra.core.global_hydra import GlobalHydra

    listed = GlobalHydra.instance().config_loader().get_group_options("scheme")
    assert set(listed) == set(options("scheme")) == set(SCHEMES) | {"learned_16k"}  # what `scheme=` accepts
    assert {"tiny", "small", "base"} <= set(options("model"))
    assert {"shakespeare", "text"} <= set(options("data"))
    assert "fast" in options("debug") and "demo" in options("experiment")


@pytest.mark.parametrize("group, option", ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_config_option_composes_and_finalizes(group, option, hydra_ctx, text_files):
    overrides = [f"{group}={option}"]
    if group == "data" and option == "text":
        overrides += text_files
    cfg = compose("train", overrides=overrides)
    finalize(cfg)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    if group in ("scheme", "data"):
        assert cfg[group].name == option.removesuffix("_16k")  # the option's name field matches its option name
    if group == "model":
        assert cfg.model.name == option
        assert cfg.model.d_model % cfg.model.n_head == 0
    lengths = list(cfg.eval.lengths)
    assert lengths and all(n >= 2 for n in lengths)


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_job_of_an_experiment_sweep_finalizes(experiment, hydra_ctx):
    """An experiment's declared sweep (hydra.sweeper.params) expands to jobs that all compose and check."""
    declared = OmegaConf.select(compose("train", overrides=[f"experiment={experiment}"], return_hydra_config=True),
                                "hydra.sweeper.params") or {}
    axes = [[f"{key}={value.strip()}" for value in str(values).split(",")] for key, values in declared.items()]
    for job in itertools.product(*axes):
        cfg = compose("train", overrides=[f"experiment={experiment}", *job])
        if cfg.train.steps == 0:  # a preset that fine-tunes a parent (experiment=extend: read by train_job.prepare)
            cfg.init_from = "outputs/parent"
        finalize(cfg)
        if cfg.scheme.name == "learned":
            assert cfg.scheme.max_positions >= max(cfg.eval.lengths)


@pytest.mark.parametrize("scheme", options("scheme"))
def test_debug_fast_with_every_scheme(scheme, hydra_ctx):
    cfg = finalize(compose("train", overrides=["debug=fast", f"scheme={scheme}"]))
    assert cfg.train.seq_len == 32 and cfg.scheme.name == scheme.removesuffix("_16k")


def test_learned_16k_is_the_learned_scheme_with_16k_rows(hydra_ctx):
    cfg = finalize(compose("train", overrides=["experiment=compare_gpu", "scheme=learned_16k"]))
    assert OmegaConf.to_container(cfg.scheme) == {"name": "learned", "max_positions": 16384}
    with pytest.raises(ConfigError, match="scheme.max_positions=8192: .* cannot serve length 16384"):
        finalize(compose("train", overrides=["experiment=compare_gpu", "scheme=learned"]))  # 16·L = 8192


@pytest.mark.parametrize("scheme, expected", [
    ("rope", {"name": "rope", "base": 10000.0, "scaling": "none", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
              "original_length": None, "yarn_ramp": "reference", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "rotary_fraction": 1.0}),
    ("sinusoidal", {"name": "sinusoidal", "base": 10000.0}),
    ("learned", {"name": "learned", "max_positions": 16 * 128}), ("alibi", {"name": "alibi"}), ("nope", {"name": "nope"}),
])
def test_a_scheme_section_has_the_scheme_s_own_keys_only(scheme, expected, hydra_ctx):
    cfg = finalize(compose("train", overrides=[f"scheme={scheme}"]))
    assert OmegaConf.to_container(cfg.scheme) == expected


@pytest.mark.parametrize("overrides, words", [
    (["scheme=rope", "scheme.max_positions=64"], ["scheme.max_positions"]),
    (["scheme=alibi", "scheme.base=500"], ["scheme.base"]),
    (["scheme=rope", "scheme.base=abc"], ["scheme.base", "abc"]),
])
def test_a_scheme_option_it_lacks_is_refused_at_composition(overrides, words, hydra_ctx):
    with pytest.raises(Exception) as info:
        compose("train", overrides=overrides)
    message = str(info.value) + str(info.value.__cause__)
    assert all(w in message for w in words), message


@pytest.mark.parametrize("launcher, target", [("joblib", "joblib"), ("slurm", "submitit")])
def test_launcher_presets_compose(launcher, target, hydra_ctx):
    cfg = compose("train", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert target in cfg.hydra.launcher._target_


def test_eval_config_composes(hydra_ctx):
    cfg = compose("eval", overrides=["run=/some/run", "eval.protocol=sliding", "eval.stride=16"])
    assert cfg.run == "/some/run" and cfg.eval.stride == 16


# ---- derived defaults and value checks ------------------------------------------------------------


def test_derived_defaults(hydra_ctx):
    cfg = finalize(compose("train", overrides=["train.seq_len=64"]))
    assert list(cfg.eval.lengths) == [64, 128, 256, 512, 1024]  # L … 16L
    cfg = finalize(compose("train", overrides=["scheme=learned", "train.seq_len=64"]))
    assert cfg.scheme.max_positions == 1024  # the longest evaluation length


def test_a_head_width_given_frees_the_heads_from_dividing_the_width(hydra_ctx):
    cfg = finalize(compose("train", overrides=["model.n_head=3", "model.head_dim=20", "model.block=llama"]))
    assert (cfg.model.n_head, cfg.model.head_dim, cfg.model.d_model) == (3, 20, 128)


@pytest.mark.parametrize("overrides, words", [
    (["train.seq_len=0"], ["train.seq_len"]),
    (["train.seq_len=-3"], ["train.seq_len"]),
    (["train.steps=0"], ["train.steps"]),
    (["eval.lengths=[]"], ["eval.lengths", "empty"]),
    (["eval.lengths=[1,64]"], ["eval.lengths", "2"]),
    (["eval.lengths=[64,0]"], ["eval.lengths"]),
    (["model.n_head=3"], ["model.n_head=3", "128"]),
    (["scheme=learned", "scheme.max_positions=64", "eval.lengths=[32,128]"], ["max_positions", "64", "128"]),
    (["eval.protocol=sliding"], ["eval.stride"]),
    (["eval.protocol=sliding", "eval.stride=65", "eval.lengths=[64,128]"], ["eval.stride"]),
    (["eval.protocol=diagonal"], ["eval.protocol", "nonoverlapping", "sliding"]),
    (["eval.split=train"], ["eval.split"]),
    (["scheme.name=noscheme"], ["noscheme", "alibi", "rope"]),
    (["+scheme.bsae=500"], ["scheme.bsae=500", "base"]),
    (["scheme=learned", "scheme.max_positions=0"], ["scheme.max_positions=0"]),
    (["scheme.base=0"], ["scheme.base=0", "> 0"]),
    (["scheme=sinusoidal", "scheme.base=-2"], ["scheme.base=-2", "> 0"]),
    (["+train.seqlen=3"], ["unknown config key", "train.seqlen"]),
    (["model.dropout=1.0"], ["model.dropout=1.0", "0 <= p < 1"]),
    (["model.attn_dropout=1.0"], ["model.attn_dropout=1.0", "0 <= p < 1"]),
    (["model.attn_dropout=-0.1"], ["model.attn_dropout=-0.1", "0 <= p < 1"]),
    (["model.attn_dropout=nan"], ["model.attn_dropout=nan", "0 <= p < 1"]),
    (["model.n_kv_head=3"], ["model.n_kv_head=3", "model.n_head=4"]),
    (["model.n_kv_head=0"], ["model.n_kv_head"]),
    (["model.head_dim=7"], ["model.head_dim=7", "even"]),
    (["model.norm_eps=0"], ["model.norm_eps=0.0", "> 0"]),
    (["model.block=mamba"], ["model.block", "gpt", "llama"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) and "=" in v[0] else None)
def test_finalize_rejects(overrides, words, hydra_ctx):
    cfg = compose("train", overrides=overrides)
    with pytest.raises(ConfigError) as info:
        finalize(cfg)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_train_compile_is_on_for_cuda_and_off_for_cpu_unless_given(hydra_ctx, monkeypatch):
    """``train.compile`` null (the default) resolves, in the training job's config, to whether the run's device is
    CUDA; true or false as given wins; a re-evaluation of a recorded config (``training=False``) leaves it."""
    def compiled(*overrides, training=True):
        return finalize(compose("train", overrides=list(overrides)), training=training).train.compile

    assert compose("train").train.compile is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA
    assert compiled("train.device=cpu") is False and compiled("train.device=auto") is False
    assert compiled("train.device=cpu", "train.compile=true") is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine, as finalize and the trainer see it
    assert compiled("train.device=cuda") is True and compiled("train.device=auto") is True
    assert compiled("train.device=cuda:1") is True
    assert compiled("train.device=cpu") is False
    assert compiled("train.device=cuda", "train.compile=false") is False
    assert compiled("train.device=cuda", training=False) is None
    # how the same model runs, as train.device: a run trained on the CPU may resume on a GPU, compiled there
    cpu, gpu = {"train": {"compile": False, "device": "cpu"}}, {"train": {"compile": True, "device": "cuda"}}
    assert changed_keys(cpu, gpu) == []


def test_the_zoo_sweeps_the_registry_itself(hydra_ctx, monkeypatch):
    """experiment=zoo takes its scheme list from the registry: every scheme, and one added later too."""
    def zoo():
        cfg = compose("train", overrides=["experiment=zoo"], return_hydra_config=True)
        return str(cfg.hydra.sweeper.params.scheme).split(",")

    assert zoo() == list(SCHEMES) and {"rope", "alibi", "t5", "fire", "xpos"} <= set(zoo())
    monkeypatch.setitem(SCHEMES, "newcomer", SCHEMES["nope"])
    assert zoo()[-1] == "newcomer"
    demo = compose("train", overrides=["experiment=demo"], return_hydra_config=True).hydra.sweeper.params.scheme
    assert demo == "sinusoidal,learned,rope,alibi"  # the demo stays the four seed schemes


# ---- closed choices: declared once, on the field, checked in one loop ------------------------------------------


def test_every_closed_choice_is_declared_on_its_field():
    """The choices finalize checks are the fields' own (``choices(...)``: field metadata), each declared once."""
    import dataclasses

    from posbench.attention.dispatch import QK_NORM_LAYERS, QK_NORMS
    from posbench.attention.remap import METHODS
    from posbench.attention.temperature import ATTN_SCALES, SCALE_LAYERS
    from posbench.attention.windows import WINDOW_KINDS
    from posbench.config.schema import (
        BLOCKS,
        INIT_ROWS,
        PRECISIONS,
        PROBES,
        PROTOCOLS,
        RESUMES,
        SCHEDULES,
        SPLITS,
        PosbenchConfig,
    )

    def declared(schema, prefix=""):
        for f in dataclasses.fields(schema):
            if "choices" in f.metadata:
                yield prefix + f.name, f.metadata["choices"]
            elif dataclasses.is_dataclass(f.default_factory):
                yield from declared(f.default_factory, f"{prefix}{f.name}.")

    assert dict(declared(PosbenchConfig)) == {
        "model.attn_scale": ATTN_SCALES, "train.schedule": SCHEDULES, "eval.protocol": PROTOCOLS, "eval.split": SPLITS,
        "eval.probes": PROBES, "resume": RESUMES, "init_rows": INIT_ROWS, "train.precision": PRECISIONS,
        "model.window_kind": WINDOW_KINDS, "model.qk_norm": QK_NORMS, "model.qk_norm_layers": QK_NORM_LAYERS,
        "model.block": BLOCKS,
        "model.scale_layers": SCALE_LAYERS, "eval.remap": METHODS}


@pytest.mark.parametrize("overrides, message", [
    (["train.schedule=cosin"], "train.schedule='cosin' is unknown; choose one of: cosine, constant"),
    (["eval.split=train"], "eval.split='train' is unknown; choose one of: validation, test"),
    (["resume=sometimes"], "resume='sometimes' is unknown; choose one of: auto, never"),
    (["train.precision=fp16"], "train.precision='fp16' is unknown; choose one of: auto, fp32, bf16"),
    (["init_rows=copy"], "init_rows='copy' is unknown; choose one of: scheme, interpolate"),
    (["model.attn_scale=logn"],
     "model.attn_scale='logn' is unknown; choose one of: none, log_n, ssmax, floor_log, floor_log_n, log_n_clipped"),
    (["eval.probes=[passkey,contxt]"], "eval.probes has 'contxt'; the probes: passkey, context"),
])
def test_a_value_outside_its_fields_choices_is_refused_naming_them(overrides, message, hydra_ctx):
    with pytest.raises(ConfigError) as info:
        finalize(compose("train", overrides=overrides))
    assert str(info.value) == message


def test_check_choices_walks_the_sections_of_any_schema():
    from dataclasses import dataclass, field

    from posbench.config.checks import check_choices, choices

    @dataclass
    class Inner:
        mode: str = choices("a", "b")
        free: str = "anything"

    @dataclass
    class Outer:
        inner: Inner = field(default_factory=Inner)
        tags: list = choices("x", "y", default_factory=list)

    check_choices(OmegaConf.create({"inner": {"mode": "b", "free": "z"}, "tags": ["y", "x"]}), Outer)
    with pytest.raises(ConfigError, match=r"^inner.mode='c' is unknown; choose one of: a, b$"):
        check_choices(OmegaConf.create({"inner": {"mode": "c", "free": "z"}, "tags": []}), Outer)
    with pytest.raises(ConfigError, match=r"^tags has 'z'; the tags: x, y$"):
        check_choices(OmegaConf.create({"inner": {"mode": "a"}, "tags": ["x", "z"]}), Outer)


# ---- a warmup that takes every step; debug=fast beside a preset's lengths ------------------------------------


@pytest.mark.parametrize("overrides, warned", [
    (["train.steps=20"], "train.warmup_steps=40 >= train.steps=20: every step is a warmup step, and the learning rate "
                         "ends at 20/40 of train.lr=0.002, never reaching it; give train.warmup_steps below 20"),
    (["train.steps=40"], "train.warmup_steps=40 >= train.steps=40: every step is a warmup step, and the learning rate "
                         "reaches train.lr=0.002 only at the last step; give train.warmup_steps below 40"),
    (["train.steps=41"], None),
    (["train.steps=0", "init_from=outputs/parent"], None),  # no step at all: the parent evaluated as it is
])
def test_a_warmup_as_long_as_the_run_is_warned_about(overrides, warned, hydra_ctx, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="posbench"):
        finalize(compose("train", overrides=overrides))
        finalize(compose("train", overrides=overrides), training=False)  # a re-evaluation says nothing of training
    assert [r.getMessage() for r in caplog.records if "warmup" in r.getMessage()] == ([warned] if warned else [])


@pytest.mark.parametrize("overrides, seq_len, lengths", [
    (["debug=fast"], 32, [32, 64]),
    (["debug=fast", "experiment=extend"], 512, [128, 256, 512, 1024, 2048, 4096]),  # the preset's, not debug's
    (["debug=fast", "experiment=compare_gpu"], 512, [512, 1024, 2048, 4096, 8192, 16384]),
    (["debug=fast", "experiment=demo"], 32, [32, 64]),  # a preset without lengths: debug's
    (["debug=fast", "+extend=longer"], 128, [32, 64]),
    (["debug=fast", "train.seq_len=16"], 16, [32, 64]),
])
def test_debug_fast_keeps_a_presets_lengths(overrides, seq_len, lengths, hydra_ctx):
    cfg = compose("train", overrides=overrides)
    assert (cfg.train.seq_len, list(cfg.eval.lengths), cfg.train.steps) == (seq_len, lengths, 4)  # debug's steps
