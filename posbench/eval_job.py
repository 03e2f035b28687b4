"""``posbench eval``'s configuration: the job's schema, and the run's config with the job's settings in place.

``EvalJob`` is what ``posbench eval`` composes (``run``, ``eval.*``, ``device``, ``threads``, and ``scheme.*``:
options of the run's scheme to change, e.g. ``scheme.scaling=yarn scheme.factor=16`` on a RoPE run).
:func:`eval_config` reads the run's checkpoint, puts the job's settings into its config and checks them
(``posbench.config.finalize``); :func:`eval_overrides` gives the model overrides the changed scheme options
make (``checkpoint.build_model(spec, overrides)``). Registered by ``posbench.config.register``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from posbench import positional
from posbench.config import (DEFAULT_SCHEME, ConfigError, EvalConfig, PosbenchConfig, _check_keys, check_device,
                             finalize, scheme_schema, to_dict)


@dataclass
class EvalJob:
    """``posbench eval``: re-evaluate the checkpoint in ``run`` with these evaluation settings."""

    run: str = MISSING  # a run folder holding checkpoint.pt
    eval: EvalConfig = field(default_factory=EvalConfig)
    device: str = "auto"
    threads: Optional[int] = None
    scheme: Any = None  # options of the run's scheme to change (scheme.scaling=yarn); the stored schema: eval_schema()


_EVAL_SCHEMAS: dict[tuple, type] = {}  # the registry's (name, class) pairs → posbench eval's schema


def eval_schema() -> type:
    """The structured config of ``posbench eval``: :class:`EvalJob` whose ``scheme`` node takes every option of
    every scheme in ``positional.SCHEMES`` (their types, Optional, default None: not given), so that
    ``scheme.scaling=yarn`` composes and ``scheme.factor=abc`` or a key no scheme has fails at composition.
    Which of them the run's scheme has is checked by :func:`eval_config`. Importable as
    ``posbench.eval_job.eval_options`` and ``posbench.eval_job.eval_job``."""
    key = tuple((name, cls) for name, cls in positional.SCHEMES.items())
    if key not in _EVAL_SCHEMAS:
        options: dict[str, Any] = {}
        for cls in positional.SCHEMES.values():
            types = typing.get_type_hints(cls.Config)
            for f in dataclasses.fields(cls.Config):
                kind = Optional[types[f.name]]
                options[f.name] = kind if options.get(f.name, kind) == kind else Any  # two schemes, two types: Any
        scheme = dataclasses.make_dataclass("eval_options", [(k, t, field(default=None)) for k, t in options.items()])
        job = dataclasses.make_dataclass("eval_job", [("scheme", scheme, field(default_factory=scheme))],
                                         bases=(EvalJob,))
        for made in (scheme, job):
            made.__module__ = __name__
        _EVAL_SCHEMAS.clear()
        _EVAL_SCHEMAS[key] = job
    return _EVAL_SCHEMAS[key]

def __getattr__(attr: str):  # pickle looks the generated schemas up by name, in a fresh process too
    if attr in ("eval_job", "eval_options"):
        job = eval_schema()
        return job if attr == "eval_job" else job.__dataclass_fields__["scheme"].type
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def eval_config(job: DictConfig, schemes=None) -> tuple[DictConfig, dict]:
    """``posbench eval``: the run's resolved config with ``job.eval`` in place of its evaluation settings, and
    the options given in ``job.scheme`` (those not None) in place of its scheme's (``scheme.scaling=yarn
    scheme.factor=16`` on a RoPE run). The model is then rebuilt from the checkpoint's spec with the changed
    options (:func:`eval_overrides`).

    Returns (checked config, checkpoint dict). Raises ConfigError for a run folder without a readable
    checkpoint of a known format, for evaluation settings the run cannot serve (see :func:`finalize`), for a
    scheme option the run's scheme lacks (the message lists its options), a value of the wrong type or one the
    scheme's ``resolve`` refuses, and for options with which the checkpoint's weights no longer fit the model.
    """
    from posbench import checkpoint

    _check_keys(job, EvalJob())
    path = Path(job.run) / checkpoint.NAME
    try:
        state = checkpoint.read(path)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"run={job.run!r}: {e}") from None
    check_device("device", job.device)
    cfg = OmegaConf.merge(OmegaConf.structured(PosbenchConfig), state["config"])  # read() upgraded it
    cfg.eval = job.eval
    given = job.get("scheme")
    given = {k: v for k, v in to_dict(given).items() if v is not None} if isinstance(given, DictConfig) else {}
    if given:
        cfg.scheme = _changed_scheme(cfg.scheme, given, job.run, schemes)
    cfg = finalize(cfg, schemes)
    if given:
        _check_fit(state, eval_overrides(cfg, state), given)
    return cfg, state


def _changed_scheme(scheme: DictConfig, given: dict, run: str, schemes=None) -> DictConfig:
    """The run's scheme section with the ``given`` options in place, type-checked against the scheme's schema."""
    schemes = positional.SCHEMES if schemes is None else schemes
    name = scheme.name
    allowed = schemes[name].options() if name in schemes else []
    for key, value in given.items():
        if key not in allowed:
            raise ConfigError(f"scheme.{key}={value!r}: the run {run!r} has the {name} scheme, which has no option "
                              f"{key!r}; its options: {', '.join(allowed) or 'none'}")
    try:
        return OmegaConf.merge(OmegaConf.structured(scheme_schema(name)), scheme, given)
    except Exception as e:  # OmegaConf's validation errors
        key = getattr(e, "full_key", None) or next(iter(given))
        raise ConfigError(f"scheme.{key}: {str(getattr(e, 'msg', None) or e).splitlines()[0]}") from None


def eval_overrides(cfg: DictConfig, state: dict) -> dict:
    """The model overrides of ``posbench eval``: ``{"scheme": {option: value}}`` for every option of the resolved
    ``cfg.scheme`` that differs from the checkpoint's spec (an option the spec lacks reads as the scheme's
    ``Config`` default), or ``{}`` when there is none: ``checkpoint.build_model(spec, overrides)`` is then the
    model ``cfg`` describes."""
    from posbench import checkpoint

    spec = (state.get("spec") or checkpoint.model_spec(state["config"], state["vocab_size"]))["scheme"]
    cls = positional.SCHEMES[cfg.scheme.name]
    defaults = dataclasses.asdict(cls.Config())
    changed = {k: v for k, v in to_dict(cfg.scheme).items()
               if k != "name" and v != spec.get(k, defaults.get(k))}
    return {"scheme": changed} if changed else {}


def _check_fit(state: dict, overrides: dict, given: dict) -> None:
    """Raise ConfigError unless the scheme built with ``overrides`` takes the checkpoint's scheme weights (same
    names and shapes), and its constructor accepts the options."""
    import torch

    from posbench import checkpoint

    if not overrides:
        return
    spec = state.get("spec") or checkpoint.model_spec(state["config"], state["vocab_size"])
    options = {**spec["scheme"], **overrides["scheme"]}
    name = options.pop("name", DEFAULT_SCHEME)
    changed = ", ".join(f"scheme.{k}={v!r}" for k, v in given.items())
    try:
        with torch.random.fork_rng(devices=[]):
            scheme = positional.build_scheme(name, spec["model"]["d_model"], spec["model"]["n_head"], **options)
    except ValueError as e:
        raise ConfigError(f"{changed}: {e}") from None
    built = {f"scheme.{k}": tuple(v.shape) for k, v in scheme.state_dict().items()}
    saved = {k: tuple(v.shape) for k, v in state["model"].items() if k.startswith("scheme.")}
    if built != saved:
        raise ConfigError(f"{changed}: the run's trained {name} weights do not fit a model built with it "
                          f"(the checkpoint has {saved or 'no scheme weights'}, the model {built or 'none'})")
