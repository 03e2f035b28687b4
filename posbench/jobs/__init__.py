"""What ``posbench train``, ``eval`` and ``export`` compose and run: what a job reads (inputs), the command line's
overrides before composition (overrides), the training job prepared (train_job), the re-evaluation job prepared and run
(eval_job), a run written as a Hugging Face model folder (export_job), and every job of a command line prepared before
Hydra starts (command).

Imports every wing below it; only posbench/cli.py imports it. Start with command.py.
"""
