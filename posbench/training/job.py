"""A training run, ready to run: :class:`TrainJob`, what ``posbench.training.loop.train`` takes and never derives again.

posbench/jobs/train_job.py makes one from a composed config (``prepare``), before Hydra makes or touches any folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from omegaconf import DictConfig

from posbench.config.schema import to_dict
from posbench.data.cache import Corpus
from posbench.data.needles import Needle
from posbench.evaluation.results import run_label
from posbench.training.lineage import Parent


@dataclass(frozen=True)
class TrainJob:
    """One training run, ready: nothing of it is derived again.

    Attributes:
        config: the finalized config (``posbench.config.schema.finalize``): derived defaults filled, every value checked.
        corpus: the prepared corpus, its splits checked against the train and evaluation lengths.
        spec: the model spec (posbench/model/build.py): vocabulary size, model sizes, the scheme and its resolved options.
        run_dir: the folder the training state was looked for in; None: not yet (a sweep's job, before Hydra
            names its folder).
        state: the training state to resume in ``run_dir`` (``resume=auto``), or None.
        parent: the run whose weights this one starts from (``init_from``: posbench/training/lineage.py), or None.
        needle: the passkey format (posbench/evaluation/passkey.py) when the run trains with needles (``data.passkey_rate``)
            or probes with them (``eval.probes=[passkey]``), else None.
        transfer_kind, transfer: the probe's transfer control, its key kind and needle (posbench/jobs/inputs.py
            ``transfer_of``): ``"none"`` and None without one.
    """

    config: DictConfig
    corpus: Corpus
    spec: dict
    run_dir: Path | None = None
    state: dict | None = None
    parent: Parent | None = None
    needle: Needle | None = None
    transfer_kind: str = "none"
    transfer: Needle | None = None

    @cached_property
    def lineage(self) -> dict | None:
        """What the run records of its parent (``posbench.training.lineage.Parent.lineage``; a resumed run: what its training
        state recorded when it started), or None."""
        if not self.parent:
            return None
        return (self.state or {}).get("lineage") or self.parent.lineage(self.config.init_rows)

    @cached_property
    def label(self) -> str:
        """The run's label (``rope``, ``rope+yarn×16``, ``rope+yarn×4 ft512×200``): results, wandb, report rows."""
        return run_label({**to_dict(self.config), "scheme": self.spec["scheme"]}, self.lineage)
