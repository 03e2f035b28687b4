"""posbench: train short, test long. Length-extrapolation experiments for positional encodings.

Run ``posbench --help``. The package is in wings by concern, one folder each; :data:`LEVELS` is their one map, bottom
to top. A module imports only from the wings below its own and, inside its wing, from the levels below its own
(tests/test_layers.py enforces it), so each wing can be read knowing only the ones below it.
"""

__version__ = "0.1.0"

# (wing, its levels bottom to top); "" is the package's own top. "*": the wing's modules no level names (a scheme
# family file needs no entry). A wing's __init__ is a docstring unless a level names it (the schemes' registry).
LEVELS: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    # devices and threads, torchrun ranks, free memory, one GPU per sweep job, stop signals, the run folder's lock,
    # a sweep's stop, timers; wandb
    ("runtime", (("device", "dist", "free_memory", "gpus", "signals", "runlock", "sweep_stop", "timers"),
                 ("tracking",))),
    # the PositionalScheme interface, RoPE's scalings, the scheme families, the registry
    ("schemes", (("base", "rope_scaling"), ("*",), ("__init__",))),
    # windows, temperatures; SDPA per block of queries; Flex, the remap methods; which kernel runs, the plain kernels,
    # the remap kernel; each kernel's context parts; the context and attend the model calls
    ("attention", (("windows", "temperature"), ("blockwise",), ("flex", "remap"), ("choice", "dense", "remap_kernel"),
                   ("builders",), ("dispatch",))),
    # corpora and their splits, the passkey needle; the token-id cache, the training batches
    ("data", (("corpora", "needles"), ("cache", "batches"))),
    # significance tests, perplexity protocols; the probes and the passkey cells; one run's record
    ("evaluation", (("stats", "perplexity"), ("passkey", "context", "retrieval"), ("results",))),
    # the value checks, conf/'s resolvers; the evaluation's, remap's and model's checks; the schema and finalize; older records
    ("config", (("checks", "resolvers"), ("eval_checks", "model_checks"), ("schema",), ("upgrade",))),
    # the tied head and loss in one op, the attention layer and the blocks; the decoder; spec → model; the memory
    # estimate, a pretrained checkpoint as a model; a model as a Hugging Face one
    ("model", (("head", "blocks"), ("gpt",), ("build",), ("memory", "pretrained"), ("export",))),
    # the optimizer, checkpoint files; init_from, training states; a prepared run; the loop
    ("training", (("optim", "checkpoint"), ("lineage", "states"), ("job",), ("loop",))),
    # many runs: what plots write on their axes, how the records' settings differ and their rows; the plots, which
    # records; their numbers and series; the report
    ("report", (("axes", "settings"), ("plots", "records"), ("compare", "probe_tables"), ("render",))),
    # what a command line composes and runs: inputs and overrides; the train, eval and export jobs; every job of a
    # command line
    ("jobs", (("inputs", "overrides"), ("train_job", "eval_job", "export_job"), ("command",))),
    # the command line, and python -m posbench
    ("", (("cli",), ("__main__",))),
)
