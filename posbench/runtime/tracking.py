"""wandb, and nothing else, behind one small object: :class:`Tracker`.

Offline by default (``WANDB_MODE`` respected; ``wandb sync <run>/wandb/offline-run-*`` uploads later),
the run's files inside the run folder, only rank 0 logs. What a run logs:

* train/loss, train/lr, train/grad_norm, train/tokens_per_s against the optimizer step;
* eval/ppl and eval/nll against ``eval/length`` (``define_metric`` with the length as step metric);
* the per-position NLL of every evaluation length as a line plot;
* the probes' summaries: ``passkey/accuracy@<T>``, ``context/diff@<T>``.

Disabled trackers (``wandb.enabled=false``, WANDB_MODE=disabled, or ranks > 0) accept every call and do nothing.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from posbench.runtime import dist


class Tracker:
    """One wandb run, or nothing.

    Args:
        enabled: log at all (False for ranks other than 0).
        out_dir: the run folder; wandb writes ``out_dir/wandb/``.
        project, entity: wandb project and entity (None = the user's default entity).
        name: run name, e.g. the overrides that differ between jobs of a sweep (``scheme=alibi,seed=1``).
        group: the sweep (its folder name), so a sweep's runs are grouped in the dashboard.
        config: the resolved config (a plain dict), logged as the run config.
        job_type: ``train``, ``eval`` or ``report``. A ``train`` run keeps its wandb id in
            ``out_dir/wandb/run-id`` and resumes it (``resume="allow"``), so a run killed and resumed in the same
            folder is one wandb run; its offline files are synced into that one run.
    """

    def __init__(self, enabled: bool, out_dir: Path, project: str, entity: str | None = None,
                 name: str | None = None, group: str | None = None, config: dict | None = None,
                 job_type: str = "train", tags: list | None = None):
        self.run = None
        if not enabled or os.environ.get("WANDB_MODE", "offline") == "disabled":
            return
        import wandb  # here, not at the top: a run with wandb off never pays its import

        resume = {}
        if job_type == "train":  # one wandb run per run folder: a resumed run continues the one it started
            id_file = Path(out_dir) / "wandb" / "run-id"
            if not id_file.is_file():
                id_file.parent.mkdir(parents=True, exist_ok=True)
                id_file.write_text(uuid.uuid4().hex[:8] + "\n")  # a wandb run id: 8 characters [0-9a-f]
            resume = {"id": id_file.read_text().strip(), "resume": "allow"}
        self.run = wandb.init(project=project, entity=entity, name=name, group=group, config=config,
                              dir=str(out_dir), job_type=job_type, tags=tags, **resume,
                              mode=os.environ.get("WANDB_MODE", "offline"), reinit="finish_previous",
                              settings=wandb.Settings(console="off", x_disable_stats=True, save_code=False))
        self.run.define_metric("train/*", step_metric="trainer/step")
        self.run.define_metric("eval/length")
        self.run.define_metric("eval/*", step_metric="eval/length")
        self._step = 0

    @classmethod
    def from_config(cls, cfg, out_dir: Path, job_type: str, name: str | None = None, sweep_dir: Path | None = None,
                    config: dict | None = None) -> "Tracker":
        """The tracker a job's config asks for (``cfg.wandb``: enabled, project, entity, tags), on rank 0 only, in
        the wandb group of the sweep folder ``sweep_dir`` (:func:`sweep_group`; None: no group)."""
        w = cfg.wandb
        return cls(w.enabled and dist.rank() == 0, out_dir, w.project, w.entity, name=name,
                   group=sweep_group(sweep_dir) if sweep_dir else None, config=config, job_type=job_type,
                   tags=list(w.tags))

    def log_train(self, step: int, **metrics: float) -> None:
        """Training metrics at optimizer ``step`` (loss in nats/token, lr, grad_norm, tokens_per_s)."""
        if self.run:
            self._log({"trainer/step": step, **{f"train/{k}": v for k, v in metrics.items()}})

    def log_eval(self, rows: list[dict], prefix: str = "eval") -> None:
        """Perplexity/NLL per evaluation length, and each length's per-position NLL as a line plot."""
        if not self.run:
            return
        import wandb  # (as in __init__: only a run with wandb on imports it)

        for r in rows:
            self._log({f"{prefix}/length": r["length"], f"{prefix}/ppl": r["ppl"], f"{prefix}/nll": r["nll"]})
        for r in rows:
            pos = r["nll_by_position"]
            table = wandb.Table(columns=["position", "nll"], data=[[p + 1, v] for p, v in zip(pos["position"], pos["nll"])])
            self._log({f"{prefix}/length": r["length"], f"{prefix}/nll_by_position_{r['length']}": wandb.plot.line(
                table, "position", "nll", title=f"NLL by position, evaluation length {r['length']}")})

    def log_report(self, series: dict[str, tuple[list, list]], images: dict[str, Path]) -> None:
        """A sweep's report: perplexity vs length of every scheme in one chart, and the report's PNGs."""
        if not self.run:
            return
        import wandb  # (as in __init__: only a run with wandb on imports it)

        xs = sorted({x for x_list, _ in series.values() for x in x_list})
        ys = [[dict(zip(x_list, y_list)).get(x, float("nan")) for x in xs] for x_list, y_list in series.values()]
        chart = wandb.plot.line_series(xs=xs, ys=ys, keys=list(series), title="Perplexity vs evaluation length",
                                       xname="evaluation length")
        self._log({"report/ppl_vs_length": chart, **{f"report/{k}": wandb.Image(str(p)) for k, p in images.items()}})

    def log_passkey(self, accuracy: dict[int, float] | None, transfer: dict[int, float] | None = None) -> None:
        """A passkey probe's exact-match accuracy per probe length (``posbench.evaluation.passkey.accuracy`` of a
        record's trials), as run-summary values ``passkey/accuracy@<T>``, and its transfer control's as
        ``passkey/transfer@<T>``; nothing for None."""
        if accuracy:
            self.summary(**{f"passkey/accuracy@{n}": a for n, a in accuracy.items()},
                         **{f"passkey/transfer@{n}": a for n, a in (transfer or {}).items()})

    def log_context(self, probe: dict | None) -> None:
        """A results record's context probe (``context``: posbench/evaluation/context.py), as run-summary values
        ``context/diff@<T>`` (mean NLL_full − NLL_short past L, nats/token, per evaluation length); nothing without one."""
        if probe:
            self.summary(**{f"context/diff@{r['length']}": r["diff"] for r in probe["rows"]})

    def summary(self, **values) -> None:
        """Set run-summary values (e.g. status=failed)."""
        if self.run:
            self.run.summary.update(values)

    def _log(self, data: dict) -> None:
        self.run.log(data, step=self._step)  # one history row per call; charts use the step metrics above
        self._step += 1

    def finish(self, exit_code: int = 0) -> None:
        if self.run:
            self.run.finish(exit_code=exit_code)
            self.run = None


def sweep_group(sweep_dir: Path) -> str:
    """The wandb group of a sweep: its folder's last two parts (``2026-11-21/10-00-00``)."""
    return "/".join(Path(sweep_dir).parts[-2:])
