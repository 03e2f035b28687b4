"""The ``posbench`` command: ``posbench <train|eval|report> [Hydra overrides or options]``.

    posbench train scheme=alibi train.seq_len=64             # one run into outputs/<date>/<time>_alibi
    posbench train -m experiment=demo                        # the four-scheme sweep; a table at the end
    posbench train --cfg job                                 # print the composed config (any Hydra flag works)

Each subcommand is one ``@hydra.main``. Before Hydra starts, every job of the command line (each
combination of a sweep, the experiment's declared sweep included) is composed and checked, so a typo,
a wrong type or a bad value stops everything with one line on stderr and exit status 2, before any
folder is made, any data is read or any step is trained.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the Hub is opt-in: set HF_HUB_OFFLINE=0 to download corpora
os.environ.setdefault("WANDB_MODE", "offline")

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from posbench.config import ConfigError, finalize, register  # noqa: E402
from posbench.data import DataError  # noqa: E402
from posbench.positional import SCHEMES  # noqa: E402

CONFIG_MODULE = "posbench.conf"
USAGE = """usage: posbench <command> [overrides...]

commands:
  train    train at length L, evaluate at L..16L        posbench train scheme=alibi
  eval     re-evaluate a trained run (next release)
  report   tables and plots from runs (next release)

Overrides are Hydra's: key=value, group=option, -m for a sweep, --cfg job to print the config."""


def fail(message: str) -> None:
    """Print one error line and exit with status 2."""
    print(f"posbench: error: {message}", file=sys.stderr)
    sys.exit(2)


def _one_line(err: Exception) -> str:
    """Hydra's and OmegaConf's multi-line composition errors, as one line naming the value and the choices."""
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, name = err.missing_cfg_file.rsplit("/", 1)
        return f"unknown {group} {name!r}; choose one of: {', '.join(err.options or [])}"
    while err.__cause__ is not None:
        err = err.__cause__
    key = getattr(err, "full_key", None)
    text = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
    if "not in struct" in text:
        return f"unknown config key {key!r}; see the keys with: posbench train --cfg job"
    if key and "could not be converted" in text:
        return f"{key}: {text.replace('Value', 'value', 1)}"
    return f"{key}: {text}" if key else text


def _jobs(overrides: list[str], multirun: bool, config_name: str) -> list[list[str]]:
    """The override lists of every job the command line asks for (sweeps expanded, the config's own too)."""
    from hydra import compose
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    if not multirun:
        return [overrides]
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    declared = compose(config_name, overrides=fixed, return_hydra_config=True).hydra.sweeper.params or {}
    given = {o.key_or_group for o in parsed}
    parsed += parser.parse_overrides([f"{k}={v}" for k, v in declared.items() if k not in given])
    axes = [[f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line]
            for o in parsed]
    return [list(c) for c in itertools.product(*axes)]


def preflight(argv: list[str], config_name: str) -> None:
    """Compose and check every job of ``argv``; exit with one error line on the first bad one."""
    from hydra import compose, initialize_config_module

    flags = [a for a in argv if a.startswith("-")]
    if any(f not in ("-m", "--multirun") for f in flags):
        return  # --cfg, --help, --info ...: Hydra's own business
    overrides = [a for a in argv if not a.startswith("-")]
    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            for job in _jobs(overrides, bool(flags), config_name):
                finalize(compose(config_name, overrides=job), SCHEMES)
    except ConfigError as e:
        fail(str(e))
    except Exception as e:  # Hydra / OmegaConf composition errors
        fail(_one_line(e))


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="train", version_base="1.3")
def _train(cfg: DictConfig) -> None:
    from posbench.train import train

    try:
        train(cfg, Path(HydraConfig.get().runtime.output_dir))
    except (ConfigError, DataError) as e:
        fail(str(e))


COMMANDS = {"train": (_train, "train")}


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``posbench`` console script and of ``python -m posbench``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        fail(f"unknown command {command!r}; choose one of: {', '.join(COMMANDS)}")
    task, config_name = COMMANDS[command]
    register()
    preflight(rest, config_name)
    sys.argv = [f"posbench-{command}", *rest]
    task()
