"""The OmegaConf resolvers conf/'s files use, registered wherever posbench.config.schema is imported (joblib and SLURM
workers as well): ``${posbench_times:${train.seq_len},0.25}`` (a length as a multiple of L) and ``${posbench_label:}``
(the run's label as a folder name's part, conf/train.yaml's run and sweep folders) and ``${posbench_eval_dir:…}`` (the
folder posbench eval writes into).
"""

from __future__ import annotations

from omegaconf import OmegaConf

from posbench.evaluation.results import checkpoint_name, file_label, run_label


def times(value, factor) -> int:
    """``${posbench_times:${train.seq_len},0.25}``: ``value`` × ``factor`` as an int (rounded), so that a preset can
    give a length as a multiple of L (conf/hybrid/: W = L/4, L_t = 16L) that follows ``train.seq_len`` (debug=fast's
    L = 32 too). Registered with OmegaConf wherever this module is imported (joblib and SLURM workers as well)."""
    return int(round(float(value) * float(factor)))


OmegaConf.register_new_resolver("posbench_times", times, replace=True)


def run_name(*, _root_) -> str:
    """``${posbench_label:}``: the run's label as a folder name's part (``rope+LLLG_w32_G-nope``; ``rope`` for a plain
    RoPE run: ``posbench.evaluation.results.run_label`` and ``file_label``), so that conf/train.yaml's run and sweep
    folders tell a hybrid, a trick or a scaling from the plain scheme. A fine-tune's parent is not known here: its
    folder names what it trains, without the ``ft`` part."""
    config = {k: OmegaConf.to_container(_root_[k], resolve=True) for k in ("scheme", "model", "train", "eval")}
    return file_label(run_label(config))


OmegaConf.register_new_resolver("posbench_label", run_name, replace=True)


def eval_dir(run, pretrained) -> str:
    """``${posbench_eval_dir:${run},${pretrained}}``: the folder ``posbench eval`` writes into, conf/eval.yaml's run
    folder: the run's own, or for a pretrained checkpoint ``outputs/pretrained/<its name>``
    (``posbench.evaluation.results.checkpoint_name``), where every evaluation of it gathers for the report."""
    if run or not pretrained:
        return str(run)
    return f"outputs/pretrained/{checkpoint_name(str(pretrained))}"


OmegaConf.register_new_resolver("posbench_eval_dir", eval_dir, replace=True)
