"""``posbench train``'s job: a composed config made ready to run, once, before Hydra makes or touches any folder.

:func:`prepare` finalizes the config (derived defaults filled, every value checked, the scheme's options resolved:
posbench/config/schema.py), prepares the corpus into its cache and checks that its splits can serve the run, makes the
model spec, and, given the run folder, finds the training state the run resumes there (posbench/training/states.py).
The CLI prepares every job of a command line this way before the first one starts, and hands each job on to
``posbench.training.loop.train``, which takes it as it is.

    job = prepare(cfg, run_dir)   # cfg: the composed DictConfig; raises ConfigError or DataError
    train(job, tracker)           # posbench/training/loop.py
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from posbench.config.checks import ConfigError, longest_length
from posbench.config.schema import finalize, to_dict
from posbench.data import needles
from posbench.jobs.inputs import needle_of, prepare_data, transfer_of
from posbench.model import build, memory
from posbench.runtime import dist
from posbench.runtime.device import resolve_device
from posbench.training import lineage
from posbench.training.job import TrainJob
from posbench.training.states import resume_state

log = logging.getLogger("posbench")


def prepare(cfg: DictConfig, run_dir: Path | None = None) -> TrainJob:
    """The job of the composed config ``cfg`` (finalized in place), in ``run_dir`` when it is known. A run started
    from a parent (``init_from``) logs the options that differ from the parent's (``key: parent's → its own``).

    Raises:
        ConfigError: a bad value (``posbench.config.schema.finalize``), splits too short for the lengths, a step that
            cannot fit in the device's memory (:func:`check_memory`), a parent (``init_from``) the run cannot start
            from (``posbench.training.lineage.read`` and ``check``), or a training state in ``run_dir`` the run cannot resume
            (:func:`posbench.training.states.resume_state`).
        posbench.data.cache.DataError: unusable data.
    """
    parent = lineage.read(cfg.init_from) if cfg.get("init_from") else None
    if parent:
        lineage.inherit(cfg, parent)
    finalize(cfg, trained_length=parent.length if parent else None)
    if parent:  # before the data: a refused run leaves no cache behind
        lineage.check_config(cfg, parent)
        changed = lineage.differences(parent.state["config"], to_dict(cfg))
        log.info("init_from=%s: %s", cfg.init_from, f"the options that differ from the parent's: {', '.join(changed)}"
                 if changed else "no option differs from the parent's")
    corpus = prepare_data(cfg)
    # a pretrained parent's embedding rows, which may outnumber its tokenizer's tokens (Qwen's), else the corpus's
    vocab = parent.state["vocab_size"] if parent and parent.pretrained else corpus.vocab_size
    kind, transfer = transfer_of(cfg, corpus, needles.trained_keys(to_dict(cfg)))
    job = TrainJob(cfg, corpus, build.spec(to_dict(cfg), vocab), parent=parent, needle=needle_of(cfg, corpus),
                   transfer_kind=kind, transfer=transfer)
    if parent:
        lineage.check(cfg, parent, job.spec, corpus.tokenizer_path)
    if not _on_cuda(job):  # a GPU's free memory is read in the process that trains, on its own GPU: in_folder
        check_memory(job)
    return job if run_dir is None else in_folder(job, run_dir)


def _on_cuda(job: TrainJob) -> bool:
    return resolve_device(job.config.train.device).type == "cuda"


def check_memory(job: TrainJob) -> None:
    """Raise ConfigError when a training step (if the run takes one), or the evaluation's forward pass at the longest
    length, needs more memory than the training device has available now (estimated by posbench/model/memory.py; the
    message gives both and names ``train.check_memory=false``, which skips the check)."""
    t, e = job.config.train, job.config.eval
    if not t.check_memory:
        return
    device = torch.device(dist.device_of(str(resolve_device(t.device))))
    longest = longest_length(e)
    try:  # (each layer's kernel: posbench.model.memory.layer_kernels)
        if t.steps:  # (0 steps: a parent evaluated as it is, no training step)
            memory.check_fits(job.spec, t.batch_size, t.seq_len, None, device,
                              f"train.seq_len={t.seq_len} × train.batch_size={t.batch_size}")
        memory.check_fits(job.spec, max(1, e.batch_tokens // longest), longest, None, device,
                          f"eval.lengths (up to {longest}) × eval.batch_tokens={e.batch_tokens}", training=False)
    except memory.MemoryTooSmall as err:
        raise ConfigError(f"{err} (or, if you know it fits, train.check_memory=false)") from None


def in_folder(job: TrainJob, run_dir: Path) -> TrainJob:
    """``job`` with the training state it resumes in ``run_dir`` (looked for once per folder).

    Raises ConfigError as :func:`posbench.training.states.resume_state`, or, on CUDA, as :func:`check_memory`."""
    run_dir = Path(run_dir)
    if job.run_dir == run_dir:
        return job
    if _on_cuda(job):
        check_memory(job)
    if job.parent and job.parent.path.parent.resolve() == run_dir.resolve():
        raise ConfigError(f"init_from={job.config.init_from} is this run's own folder: a run starts from another run's "
                          "weights; choose a new folder with hydra.run.dir=DIR")
    return dataclasses.replace(job, run_dir=run_dir, state=resume_state(job.config, run_dir))
