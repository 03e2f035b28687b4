"""``posbench eval``'s job: a trained run's checkpoint scored again with other evaluation settings (and, optionally,
other options of its scheme, e.g. ``scheme.scaling=yarn scheme.factor=16`` on a RoPE run, or a zero-shot temperature,
``model.attn_scale=floor_log``: posbench/attention/temperature.py), written beside the run's results, never over them;
or a pretrained checkpoint (``pretrained=``: posbench/model/pretrained.py) scored the same way, on the run config its
own config makes (its block, sizes and RoPE as ``model.*`` and ``scheme.*``, its L as ``train.seq_len``, the default
corpus tokenised with its tokenizer), its results in ``outputs/pretrained/<its name>``.

:func:`prepare` does everything that can fail, once, before Hydra writes into the run folder: it reads the
checkpoint, puts the job's settings into the run's config and finalizes it (the scheme's options resolved:
posbench/config/schema.py), prepares the corpus and checks its split, and builds the model with the changed options and
loads the trained weights into it (a misfit is refused). :func:`run` scores it and writes
``eval-<label>-<protocol>-<split>-<n>.json`` / ``.csv``.

    job = prepare(job_cfg)   # job_cfg: the composed ``posbench eval`` config; raises ConfigError or DataError
    record = run(job)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from functools import cached_property
from importlib.resources import files
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from posbench.attention import remap as remapping
from posbench.attention.temperature import BETA, ZERO_SHOT
from posbench.config.checks import ConfigError, check_device, check_keys
from posbench.config.eval_checks import key_kinds
from posbench.config.resolvers import eval_dir
from posbench.config.schema import EvalJobConfig, PosbenchConfig, finalize, scheme_schema, to_dict
from posbench.config.upgrade import model_section
from posbench.data import cache, needles
from posbench.evaluation import context, passkey, results
from posbench.evaluation.perplexity import evaluate
from posbench.jobs.inputs import needle_of, prepare_data, transfer_of
from posbench.jobs.overrides import CONFIG_MODULE
from posbench.model import build, pretrained
from posbench.runtime import dist
from posbench.runtime.device import flush_denormals_from_now, resolve_device, set_threads
from posbench.schemes import SCHEMES
from posbench.training import checkpoint

log = logging.getLogger("posbench")
TEMPERATURE_KEYS = ("attn_scale", "scale_length", "scale_beta", "scale_layers")  # model.* posbench eval may change
TRAINED = ("log_n", "ssmax")  # temperatures the weights are trained with: never added or removed at evaluation
SIZE_KEYS = ("block", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "head_dim")  # given only as they are


@dataclass(frozen=True)
class EvalJob:
    """One re-evaluation, ready to run.

    Attributes:
        config: the run's config with the job's ``eval.*`` and changed scheme options in place, finalized.
        state: the run's checkpoint (``posbench.training.checkpoint.read``) without its weights; a pretrained
            checkpoint's: ``{"config", "spec", "vocab_size", "pretrained"}``, the last what
            ``posbench.model.pretrained.read`` says the checkpoint is.
        corpus: the run's corpus, its evaluation split checked against the lengths.
        model: the model, built with the changed options, the trained weights loaded, on the CPU; its ``remap`` the
            evaluation's training-free extension (``eval.remap``: posbench/attention/remap.py), or None.
        overrides: ``{"scheme": {...}, "model": {...}}``, the scheme options and temperature options that differ from
            the trained model's spec, each section only where one does (``{}``: the model as trained).
        run_dir: the run folder. device, threads: where to compute (``device`` checked, not yet resolved).
        needle: the passkey format when ``eval.probes`` has passkey (posbench/evaluation/passkey.py), else None.
        transfer_kind, transfer: the probe's transfer control (posbench/jobs/inputs.py ``transfer_of``), or
            ``"none"`` and None.
    """

    config: DictConfig
    state: dict
    corpus: cache.Corpus
    model: torch.nn.Module
    overrides: dict
    run_dir: Path
    device: str
    threads: int | None
    needle: needles.Needle | None = None
    transfer_kind: str = "none"
    transfer: needles.Needle | None = None

    @cached_property
    def label(self) -> str:
        """The label of the model as evaluated (``rope+yarn×16``, ``rope+yarn×4 ft512×200``, ``rope (floor_log at
        eval)``: ``posbench.evaluation.results.evaluation_label``; ``SmolLM2-135M-Instruct (yarn×4 at eval)``:
        ``pretrained_label``): the console, the eval file's name, wandb, report rows."""
        if "pretrained" in self.state:
            return results.pretrained_label(self.state["pretrained"]["name"], to_dict(self.config), self.state["config"])
        return results.evaluation_label(to_dict(self.config), self.state["config"], self.state.get("lineage"))


def prepare(job: DictConfig, run_dir: str | None = None) -> EvalJob:
    """The job of the composed ``posbench eval`` config ``job``, writing into ``run_dir`` (``hydra.run.dir``; None: its
    default, the run's folder or ``outputs/pretrained/<the checkpoint's name>``).

    Raises:
        ConfigError: neither or both of ``run`` and ``pretrained``, a run folder without a readable checkpoint of a
            known format, a pretrained checkpoint posbench cannot read or rebuild
            (``posbench.model.pretrained.PretrainedError``), a size (``model.n_head`` …) other than the model's own,
            evaluation settings the run cannot serve (``posbench.config.schema.finalize``), a scheme option the run's
            scheme lacks (the message lists its options), a value of the wrong type or one the scheme's ``resolve``
            refuses, options with which the checkpoint's weights no longer fit the model, a temperature that changes
            training (``log_n``, ``ssmax``: given, or the run's own), or an evaluation split too short for the lengths.
        posbench.data.cache.DataError: the run's corpus cannot be prepared.
    """
    check_keys(job, EvalJobConfig(), shown_by="posbench eval run=<run folder> --cfg job")
    check_device("device", job.device)
    if bool(job.run) == bool(job.pretrained):
        raise ConfigError(("run=… and pretrained=… given together" if job.run else "nothing to evaluate") +
                          ": posbench eval takes a trained run (run=<run folder>) or a pretrained checkpoint "
                          "(pretrained=<Hugging Face model folder, Hub id or .gguf file>)")
    if job.eval.probe_every:
        raise ConfigError(f"eval.probe_every={job.eval.probe_every} probes during training; posbench eval probes once: "
                          "drop it")
    source = job.run or job.pretrained
    if job.run and job.data is not None:
        raise ConfigError(f"data={job.data.get('name')}: posbench eval scores a run on its own corpus; data= is for "
                          "pretrained= checkpoints")
    cfg, state = _pretrained(job.pretrained, job.eval, job.data) if job.pretrained else _run(job.run, job.eval)
    trained = state.get("spec") or build.model_spec(state["config"], state["vocab_size"])
    model_options = to_dict(job.model) if job.get("model") else {}
    _check_sizes({k: model_options.get(k) for k in SIZE_KEYS}, trained["model"], source)
    given = {k: v for k, v in to_dict(job.scheme).items() if v is not None} if isinstance(job.get("scheme"), DictConfig) else {}
    if given:
        cfg.scheme = _changed_scheme(cfg.scheme, given, source)
    temperature = {k: v for k, v in model_options.items() if v is not None and k not in SIZE_KEYS}
    if temperature:
        _change_temperature(cfg.model, temperature, source)
    finalize(cfg, training=False)  # the job's own device is checked above; the run's train.device is history
    trained_keys = needles.trained_keys(state["config"])  # (the kind of the run's training needles, or None)
    key_kinds(cfg.eval.passkey, trained_keys, training=False)
    overrides = _overrides(to_dict(cfg.scheme), trained["scheme"], to_dict(cfg.model), trained.get("model") or {})
    model = _trained_model(state, trained, overrides, {**{f"scheme.{k}": v for k, v in given.items()},
                                                       **{f"model.{k}": v for k, v in temperature.items()}})
    state = {k: v for k, v in state.items() if k != "model"}  # (the weights are in the model now)
    model.remap = remapping.of(cfg.eval.remap, cfg.eval.remap_options)  # None, or every layer's remapped attention
    corpus = prepare_data(cfg)
    needle = needle_of(cfg, corpus) if "passkey" in cfg.eval.probes else None
    return EvalJob(cfg, state, corpus, model, overrides, Path(run_dir or eval_dir(job.run, job.pretrained)), job.device,
                   job.threads, needle, *transfer_of(cfg, corpus, trained_keys))


def _run(run: str, eval_options: DictConfig) -> tuple[DictConfig, dict]:
    """(the run's config, upgraded, on posbench's schema, with ``eval_options``; its checkpoint)."""
    try:
        state = checkpoint.read(Path(run) / checkpoint.NAME)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"run={run!r}: {e}") from None
    cfg = OmegaConf.merge(OmegaConf.structured(PosbenchConfig), state["config"])  # read() upgraded it
    cfg.eval = eval_options
    return cfg, state


def _pretrained(source: str, eval_options: DictConfig, data: DictConfig | None):
    """(the run config of the pretrained checkpoint ``source`` (``posbench.model.pretrained.as_run``), with
    ``eval_options`` and, where they give none, the lengths L/4 … 4L of its L, on the corpus ``data`` (None:
    conf/data/shakespeare.yaml) tokenised by its tokenizer; its state ``{"config", "spec", "vocab_size", "model",
    "pretrained"}``, as a run's checkpoint would hold them). The config and spec are finalized once as the checkpoint
    is, so that a scheme option given at evaluation is told from the checkpoint's own. Raises ConfigError."""
    try:
        config, state = pretrained.as_run(source)
    except pretrained.PretrainedError as e:
        raise ConfigError(str(e)) from None
    L = config["train"]["seq_len"]
    data = data if data is not None else OmegaConf.load(files(CONFIG_MODULE).joinpath("data", "shakespeare.yaml"))
    cfg = OmegaConf.merge(OmegaConf.structured(PosbenchConfig), {"data": data}, config)
    cfg.eval = eval_options
    if cfg.eval.lengths is None:
        cfg.eval.lengths = [L // 4, L // 2, L, 2 * L, 4 * L]
    own = finalize(copy.deepcopy(cfg), training=False)
    state.update(config=to_dict(own), spec=build.model_spec(to_dict(own), state["vocab_size"]))
    return cfg, state


def _check_sizes(given: dict, trained: dict, source: str) -> None:
    """Raise ConfigError for a size or block (``model.n_head=4`` …) that is not the trained model's own (``trained``:
    its spec's model; a missing ``n_kv_head`` is ``n_head``, ``head_dim`` is ``d_model / n_head``)."""
    own = {**trained, "block": trained.get("block", "gpt")}
    own["n_kv_head"] = own.get("n_kv_head") or own["n_head"]
    own["head_dim"] = own.get("head_dim") or own["d_model"] // own["n_head"]
    for key, value in given.items():
        if value is not None and value != own[key]:
            raise ConfigError(f"model.{key}={value}: {source} has model.{key}={own[key]}; posbench eval scores the "
                              "model as it was trained (its sizes and block are its own)")


def run(job: EvalJob, progress=None) -> dict:
    """Score ``job`` and return its record, written (rank 0; under torchrun the windows are sharded) to a new
    ``eval-<label>-<protocol>-<split>-<n>.json`` claimed exclusively, so earlier results are never overwritten and
    two evaluations started together write two files. The record's config holds the job's settings, and
    ``scheme_overrides`` lists the changed options (absent when the model is the trained one as it was); an
    exception while writing (Ctrl-C) removes the claimed files. ``progress``: an optional callable(str) told which
    length is being scored; by default (rank 0) each length is logged to the ``posbench`` logger (the console and
    ``eval.log``) and, on a terminal, counted by a progress bar (:func:`_progress`)."""
    device, threads, e = resolve_device(job.device), set_threads(job.threads), job.config.eval
    flush_denormals_from_now(device)
    if dist.rank() == 0:
        log.info("evaluating %s (%s): lengths %s, %s%s, %s split (%s), device %s, %d threads", job.label,
                 job.run_dir, ", ".join(map(str, e.lengths)), e.protocol,
                 f" stride {e.stride}" if e.protocol == "sliding" else "", e.split,
                 f"at most {e.max_tokens} tokens" if e.max_tokens else "all of it", device, threads)
    extra = {f"{section}_overrides": changed for section, changed in job.overrides.items()}
    extra.update({k: job.state[k] for k in ("lineage", "total_train_tokens", "pretrained") if job.state.get(k)})
    with _progress(job, progress) as progress:
        rows = evaluate(job.model.to(device), job.corpus.tokens[e.split], list(e.lengths), e.protocol, e.stride,
                        e.max_tokens, e.batch_tokens, device, progress=progress, rank=dist.rank(), world=dist.world())
        if job.needle:
            settings = {**to_dict(e.passkey), "trained_keys": needles.trained_keys(job.state["config"])}
            extra["passkey"] = passkey.record(job.model, job.corpus.tokens[e.split], job.needle, settings,
                                              e.split, job.config.train.seq_len, device, e.batch_tokens, progress,
                                              job.transfer, job.transfer_kind)
        if "context" in e.probes:  # (windows sharded over ranks, as perplexity's)
            extra["context"] = context.record(job.model, job.corpus.tokens[e.split], to_dict(e.context), e.split,
                                              job.config.train.seq_len, list(e.lengths), e.max_tokens, device,
                                              e.batch_tokens, progress, dist.rank(), dist.world())
    rec = results.record(to_dict(job.config), rows, job.label, split=e.split, train_tokens=job.state.get("train_tokens"),
                         train_seconds=None, device=str(device), threads=threads, world_size=dist.world(),
                         scored_split=job.corpus.same_as.get(e.split, e.split), **extra)
    if dist.rank() == 0:
        job.run_dir.mkdir(parents=True, exist_ok=True)  # (Hydra made it, unless run in process)
        stem = results.new_eval_stem(job.run_dir, rec["label"], e.protocol, e.split)
        try:
            path = results.write_results(job.run_dir, rec, stem)
        except BaseException:  # (Ctrl-C while writing) no half-written file left to read as a result
            for suffix in (".json", ".csv"):
                (job.run_dir / f"{stem}{suffix}").unlink(missing_ok=True)
            raise
        print(results.run_table(rec), flush=True)
        log.info("written: %s", path)
    return rec


def _steps(job: EvalJob) -> int:
    """The progress messages ``run`` gets: one per length, per passkey length, and, for the context probe, one for
    its short windows and one per length past L (posbench/evaluation/context.py)."""
    e, L = job.config.eval, job.config.train.seq_len
    past = [n for n in e.lengths if n > L]
    return (len(e.lengths) + (len(e.passkey.lengths) if job.needle else 0)
            + (1 + len(past) if "context" in e.probes and past else 0))


@contextlib.contextmanager
def _progress(job: EvalJob, given=None):
    """The ``progress`` callable of :func:`run`: ``given``, or on rank 0 one that logs each message and, as training
    does (posbench/training/loop.py), advances a tqdm bar on stderr over :func:`_steps`, off without a terminal, under CI
    and on other ranks; while the bar shows, console log lines are written above it (eval.log is unchanged)."""
    if given is not None or dist.rank() > 0:
        yield given
        return
    quiet = not sys.stderr.isatty() or bool(os.environ.get("CI"))
    done: list[str] = []
    with tqdm(total=_steps(job), desc=f"eval {job.label}", unit="length", disable=quiet, dynamic_ncols=True) as bar, \
            (contextlib.nullcontext() if quiet else logging_redirect_tqdm()):
        def progress(message: str) -> None:
            bar.set_postfix_str(message, refresh=not done)
            if done:  # the previous step is over
                bar.update()
            done.append(message)
            log.info(message)

        yield progress
        if done:
            bar.update()


def _changed_scheme(scheme: DictConfig, given: dict, run: str) -> DictConfig:
    """The run's scheme section with the ``given`` options in place, type-checked against the scheme's schema."""
    name = scheme.name
    allowed = SCHEMES[name].options() if name in SCHEMES else []
    for key, value in given.items():
        if key not in allowed:
            raise ConfigError(f"scheme.{key}={value!r}: {run} has the {name} scheme, which has no option "
                              f"{key!r}; its options: {', '.join(allowed) or 'none'}")
    try:
        return OmegaConf.merge(OmegaConf.structured(scheme_schema(name)), scheme, given)
    except Exception as e:  # noqa: BLE001 - OmegaConf's validation errors, of many kinds
        key = getattr(e, "full_key", None) or next(iter(given))
        raise ConfigError(f"scheme.{key}: {str(getattr(e, 'msg', None) or e).splitlines()[0]}") from None


def _change_temperature(model: DictConfig, given: dict, run: str) -> None:
    """Put the ``given`` temperature options into the run's finalized model section ``model`` (in place); a new
    ``model.attn_scale`` starts from its own defaults for the options not given.

    Raises ConfigError for a temperature that changes training: ``log_n`` or ``ssmax`` given, or the run's own (its
    weights were trained with it; given alone, as it is, it changes nothing and passes), and for a value of the wrong
    type."""
    trained, new = model.attn_scale, given.get("attn_scale", model.attn_scale)
    what = " ".join(f"model.{k}={v}" for k, v in given.items())
    if given == {"attn_scale": trained}:  # the run's own: no change
        return
    if trained in TRAINED:
        raise ConfigError(f"{what}: the run {run!r} was trained with model.attn_scale={trained}, which its weights "
                          "depend on; posbench eval keeps it")
    if new in TRAINED:
        raise ConfigError(f"model.attn_scale={new} changes training and cannot be applied after it; at evaluation give "
                          f"one of: none, {', '.join(ZERO_SHOT)} (1 within L)")
    fresh = {"scale_length": None, "scale_beta": BETA, "scale_layers": "all"} if new != trained else {}
    try:
        for key, value in {**fresh, **given}.items():
            model[key] = value
    except Exception as e:  # noqa: BLE001 - OmegaConf's validation errors, of many kinds
        raise ConfigError(f"{what}: {str(getattr(e, 'msg', None) or e).splitlines()[0]}") from None


def _overrides(scheme: dict, trained: dict, model: dict, trained_model: dict) -> dict:
    """``{"scheme": {option: value}, "model": {option: value}}`` for every option of the resolved ``scheme`` section
    that differs from the trained spec's ``trained`` (an option it lacks reads as the scheme's ``Config`` default) and
    every temperature option of ``model`` that differs from the trained spec's ``trained_model`` (read with today's
    defaults), each section only where one differs; ``{}`` for the model as trained."""
    defaults = dataclasses.asdict(SCHEMES[scheme["name"]].Config())
    changed = {"scheme": {k: v for k, v in scheme.items() if k != "name" and v != trained.get(k, defaults.get(k))}}
    was = model_section(trained_model)
    changed["model"] = {k: model[k] for k in TEMPERATURE_KEYS if model[k] != was[k]}
    return {section: options for section, options in changed.items() if options}


def _trained_model(state: dict, trained: dict, overrides: dict, given: dict) -> torch.nn.Module:
    """The model of the spec ``trained`` with ``overrides``, the checkpoint's weights loaded, in eval mode, on the CPU.

    Raises ConfigError when the changed options (``given``: {"scheme.<option>": value, …}) are refused by the scheme
    or the model, or give scheme weights of other names or shapes than the trained ones."""
    changed = ", ".join(f"{k}={v!r}" for k, v in given.items())
    try:
        model = build.build_model(trained, overrides)
    except ValueError as e:
        raise ConfigError(f"{changed}: {e}") from None
    built = {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith("scheme.")}
    saved = {k: tuple(v.shape) for k, v in state["model"].items() if k.startswith("scheme.")}
    if built != saved:
        raise ConfigError(f"{changed}: the run's trained {trained['scheme']['name']} weights do not fit a model built with it "
                          f"(the checkpoint has {saved or 'no scheme weights'}, the model {built or 'none'})")
    model.load_state_dict(state["model"])
    return model.eval()
