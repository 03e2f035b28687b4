"""posbench: train short, test long. Length-extrapolation experiments for positional encodings.

Run ``posbench --help``. :data:`LEVELS` is the package's one layer map: a module imports only from modules of lower
levels (tests/test_layers.py enforces it), so each level can be read knowing only the ones below it.
"""

__version__ = "0.1.0"

# Bottom to top; names relative to the package; "schemes.*": any scheme family file (a new scheme needs no entry).
LEVELS: tuple[tuple[str, ...], ...] = (
    # 0 — nothing of posbench: the scheme interface, RoPE's scalings, attention windows, corpora, the passkey probe's
    #     trials, statistics, plots, the report tier's package (it imports nothing), the optimizer, process helpers,
    #     the attention temperatures
    ("schemes.base", "schemes.rope_scaling", "windows", "corpora", "passkey", "report", "report.stats", "report.plots",
     "optim", "dist", "device", "gpus", "signals", "runlock", "temperature"),
    # 1 — the scheme families, the token cache, the evaluation protocol, bias blocks, batches, wandb, retrieval stats
    ("schemes.*", "data", "evaluate", "blockwise", "batches", "tracking", "report.retrieval"),
    # 2 — the scheme registry, the context-use probe, FlexAttention, the training-free remaps (their kernels)
    ("schemes", "context", "flex", "remap"),
    # 3 — the attention kernels, a run's record and label, the config's value checks
    ("attention", "results", "config_checks"),
    # 4 — the model, the config schema
    ("model", "config"),
    # 5 — records of older formats; what a job reads (the corpus, its splits checked; the passkey needle)
    ("upgrade", "inputs"),
    # 6 — spec → model, checkpoint files, many runs compared
    ("build", "checkpoint", "report.compare"),
    # 7 — init_from, the memory estimate, the report rendered, training states
    ("lineage", "memory", "report.render", "training_state"),
    # 8 — a training job, prepared; a re-evaluation job, prepared and run; the command line's overrides, read
    ("train_job", "eval_job", "overrides"),
    # 9 — the training loop
    ("train",),
    # 10 — every job of a command line, prepared before Hydra
    ("jobs",),
    # 11 — the command line
    ("cli",),
    # 12 — python -m posbench
    ("__main__",),
)
