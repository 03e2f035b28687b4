"""posbench: train short, test long. Length-extrapolation experiments for positional encodings.

Run ``posbench --help``. The package in layers, each importing only from the layers below it (docs/design.md §1):

    cli                        the command line: Hydra registration, every job checked before it runs
    train_job  eval_job        a composed config → a job ready to run (resolved once), and running it
    train  training_state      the training loop; a run folder's training states
    report → compare, plots    many runs' records: collected and compared, then rendered
    build  checkpoint  evaluate  results  upgrade  config
    model  attention  data  corpora
    schemes/                   the positional schemes, their registry and RoPE's scalings
    dist  device  gpus  stats  tracking
"""

__version__ = "0.1.0"
