"""The command line's overrides, read before any composition: the slips Hydra would answer with an error that does not
say the fix (:func:`slips`), ``posbench eval``'s arguments in the other commands' vocabulary (:func:`eval_argv`),
``posbench eval``'s refusal of training's config groups (:func:`check_eval_overrides`), and Hydra's and OmegaConf's
composition errors as one line (:func:`one_line`). posbench/jobs/command.py calls them; each raises :class:`Refused`, one
line that the CLI prints before exiting 2.

    slips(["scheme=alibi,rope"], multirun=False, config_name="train")   # raises Refused: a sweep needs -m
    eval_argv(["outputs/run", "train.threads=1"])                       # ["run=outputs/run", "threads=1"]
"""

from __future__ import annotations

import difflib
import re
import shlex
from importlib.resources import files
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf import ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from posbench.config.schema import PosbenchConfig, eval_schema, scheme_of
from posbench.schemes import SCHEMES
from posbench.training import checkpoint

CONFIG_MODULE = "posbench.conf"


class Refused(Exception):
    """A job the command line asks for cannot run; the message is one line naming the value and the fix."""


def one_line(err: Exception, overrides: tuple[str, ...] = (), command: str = "train") -> str:
    """Hydra's and OmegaConf's multi-line composition errors, as one line naming the value and the choices (the
    command line's ``overrides``, to name the one at fault, and its ``command``, whose keys a hint shows)."""
    if isinstance(err, OverrideParseException) or isinstance(err.__cause__, OverrideParseException):
        bad = next((o for o in overrides if not _parses(o)), None)
        reason = str(err).strip().splitlines()[0]
        return f"{bad or ' '.join(overrides)}: Hydra cannot read this override ({reason}); write key=value, a list in " \
            "brackets and quoted for the shell: 'key=[a,b]'"
    appended = re.match(r"Could not append to config\. An item is already at '([\w.]+)'", str(err))
    if appended:
        given = next((o for o in overrides if o.lstrip("+").split("=", 1)[0] == appended[1]), f"+{appended[1]}=<value>")
        return f"{given}: {appended[1]} is already a key; drop the plus: {given.lstrip('+')}"
    added = re.match(r"Could not override '([\w/]+)'\. No match in the defaults list", str(err))
    if added:  # `extend=yarn`: a group outside the defaults list is added with a plus
        given = next((o for o in overrides if o.split("=", 1)[0] == added[1]), f"{added[1]}=<option>")
        return f"{given}: {added[1]} is not in the defaults list; add it with a plus: +{given}"
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, name = err.missing_cfg_file.rsplit("/", 1)
        return f"unknown {group} {name!r}; choose one of: {', '.join(err.options or [])}"
    while err.__cause__ is not None:
        err = err.__cause__
    key = getattr(err, "full_key", None)
    text = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
        scheme = scheme_of(getattr(err, "object_type", None))
        if getattr(err, "object_type", None) is eval_schema().__dataclass_fields__["scheme"].type:
            what = "cannot change the run's scheme" if key == "scheme.name" else "knows no scheme with that option"
            return (f"{key}: posbench eval {what}; it takes options of the run's scheme only "
                    f"(see them with: posbench train scheme=<name> --cfg job)")
        if scheme is not None:
            options = ", ".join(SCHEMES[scheme].options()) or "none"
            return (f"{key} is not an option of the {scheme} scheme;{did_you_mean(key, SCHEMES[scheme].options())} "
                    f"its options: {options}")
        return f"unknown config key {key!r};{did_you_mean(key, known_keys(key, command))} see the keys with: " \
            f"{SHOW_KEYS[command]}"
    if key and "is not a ListConfig, list or tuple" in text:  # `eval.probes=passkey`: a value where a list goes
        return f"{key}={err.value}: {key} must be a list, e.g. '{key}=[{err.value}]' (quoted, for the shell)"
    if key and "could not be converted" in text:
        return f"{key}: {text.replace('Value', 'value', 1)}"
    return f"{key}: {text}" if key else text


def _parses(override: str) -> bool:
    try:
        OverridesParser.create().parse_overrides([override])
        return True
    except OverrideParseException:
        return False


def did_you_mean(key: str, names) -> str:
    """`` did you mean <name>?`` for the name among ``names`` closest to the last part of ``key`` (difflib's ratio at
    least 0.6), with ``key``'s parent before it; "" when none is close."""
    parent, _, last = key.rpartition(".")
    close = difflib.get_close_matches(last, list(names), n=1, cutoff=0.6)
    return f" did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""


def known_keys(key: str, command: str) -> list[str]:
    """The keys beside ``key`` in ``posbench <command>``'s schema (its parent section's; at the top, the config
    groups too)."""
    parent = key.rpartition(".")[0]
    node = OmegaConf.select(OmegaConf.structured(PosbenchConfig if command == "train" else eval_schema()), parent) \
        if parent else OmegaConf.structured(PosbenchConfig if command == "train" else eval_schema())
    keys = list(node.keys()) if hasattr(node, "keys") else []
    return keys if parent else [*keys, *(TRAIN_GROUPS if command == "train" else ("eval_experiment",))]


SHOW_KEYS = {"train": "posbench train --cfg job", "eval": "posbench eval run=<run folder> --cfg job"}
FINE_TUNES = ("extend",)  # the experiment presets that fine-tune a parent: refused without init_from
TRAIN_GROUPS = ("scheme", "model", "data", "experiment", "debug", "tricks", "extend", "hybrid",
                "recipe")  # conf/'s groups, train's only


EVAL_NAMES = {"train.device": "device", "train.threads": "threads"}  # train's names, posbench eval's own
HYDRA_VALUED = {"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd",
                "--config-dir", "--experimental-rerun"}  # Hydra's flags whose value is the next argument
HYDRA_INFO = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}  # --info's optional value


def eval_argv(argv: list[str]) -> list[str]:
    """``posbench eval``'s command line in the vocabulary of ``posbench train`` and ``posbench report`` too: a run
    folder given as an argument (as the report takes folders) is ``run=<folder>``; ``run=`` (or the argument) may
    name the run's checkpoint.pt, as ``init_from`` may; ``train.device=`` and ``train.threads=`` are eval's
    ``device=`` and ``threads=``. Raises Refused for an argument that is neither an override nor a run folder."""
    out = []
    for i, a in enumerate(argv):
        if a.startswith(("-", "~")) or (i and argv[i - 1] in HYDRA_VALUED) or \
                (i and argv[i - 1] in ("-i", "--info") and a in HYDRA_INFO):
            out.append(a)
            continue
        key, eq, value = a.partition("=")
        if not eq:  # an argument, as posbench report takes its folders
            key, value = "run", a
            if not (Path(a).is_dir() or Path(a).name == checkpoint.NAME):
                raise Refused(f"{a}: not a run folder; posbench eval takes the run as run=<run folder> (or its "
                              "folder alone) and its options as key=value, e.g. posbench eval run=outputs/…_alibi "
                              "eval.protocol=sliding")
        if key == "run" and Path(value).name == checkpoint.NAME:
            value = str(Path(value).parent)
        out.append(f"{EVAL_NAMES.get(key, key)}={value}")
    runs = [a for a in out if a.startswith("run=")]
    if len(runs) > 1:
        raise Refused(f"{' '.join(runs)}: posbench eval evaluates one run; for several, sweep them: posbench eval -m "
                      f"run={','.join(r.removeprefix('run=') for r in runs)}")
    return out


def bare(key: str) -> str:
    """An override's key without Hydra's prefixes and package: ``+extend@x`` → ``extend``."""
    return key.lstrip("+~").split("@")[0]


def slips(overrides: list[str], multirun: bool, config_name: str) -> None:
    """Raise Refused for the command-line slips Hydra answers with an error that does not say the fix: an override
    without a key (``=rope``), a config group given a package (``extend@pkg=yarn``), removed (``~scheme``) or added
    with a plus where the defaults list has it (``+scheme=rope``), a comma-separated value without ``-m``
    (``scheme=alibi,rope``: a sweep) and a config group given a non-string value (``debug=true``). An override Hydra
    cannot parse is left to composition, which names it (:func:`one_line`)."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException:  # (composition names it)
        return
    listed = default_groups(config_name)
    for o in parsed:
        group, value = bare(o.key_or_group), o.input_line.partition("=")[2]
        if not o.key_or_group:
            raise Refused(f"{o.input_line}: an override needs a key before '=': key=value")
        if o.package is not None and is_group(group, config_name):
            raise Refused(f"{o.input_line}: posbench's config groups take no package (@{o.package}); write "
                          f"{'+' * o.is_add()}{group}={value}")
        if o.is_delete() and group in listed:
            raise Refused(f"{o.input_line}: {group} cannot be removed from the defaults list; choose one of its options: "
                          f"{', '.join(group_options(group))}")
        if o.is_add() and group in listed:
            raise Refused(f"{o.input_line}: {group} is already in the defaults list; drop the plus: {group}={value}")
        if o.is_sweep_override():
            if multirun:
                continue
            if o.value_type == ValueType.SIMPLE_CHOICE_SWEEP and is_list(o.key_or_group.lstrip("+"), config_name):
                raise Refused(f"{o.input_line}: {o.key_or_group} takes a list, written in brackets (quoted, for the "
                              f"shell): '{o.key_or_group}=[{o.input_line.split('=', 1)[1]}]'; without -m a "
                              "comma-separated value is a sweep")
            kept = [a for a in overrides if not a.startswith("hydra.run.")]  # a sweep writes under hydra.sweep.dir
            raise Refused(f"{o.input_line}: a sweep value, which runs with -m: posbench {config_name} -m {shlex.join(kept)}")
        if group in TRAIN_GROUPS and o.value() is not None and not isinstance(o.value(), str):
            raise Refused(f"{o.input_line}: {group} is a config group; choose one of its options: "
                          f"{', '.join(group_options(group))}")


def is_list(key: str, config_name: str) -> bool:
    """Whether ``key`` (dotted) is a list in the schema of ``posbench <config_name>``."""
    schema = OmegaConf.structured(PosbenchConfig if config_name == "train" else eval_schema())
    try:
        return isinstance(OmegaConf.select(schema, key, throw_on_missing=False), ListConfig)
    except Exception:  # noqa: BLE001 - a key the schema cannot select (the scheme's): not a list of the schema's
        return False


def group_options(group: str) -> list[str]:
    """The options of one of conf/'s config groups (its YAML files' names; the scheme group's also the registered
    schemes, which the CLI stores in Hydra's ConfigStore), sorted."""
    stored = list(SCHEMES) if group == "scheme" else []
    return sorted({*stored, *(f.name.removesuffix(".yaml") for f in files(CONFIG_MODULE).joinpath(group).iterdir()
                              if f.name.endswith(".yaml"))})


def is_group(name: str, config_name: str) -> bool:
    """Whether ``name`` is one of conf/'s config groups (``scheme``, ``hydra/launcher``, …) for ``posbench <config_name>``."""
    return name in TRAIN_GROUPS + ("eval_experiment",) or files(CONFIG_MODULE).joinpath(name).is_dir() or \
        name.startswith("hydra/")


def default_groups(config_name: str) -> set[str]:
    """The config groups in the defaults list of conf/<config_name>.yaml (``scheme``, ``model``, ``data``, …)."""
    defaults = OmegaConf.to_container(OmegaConf.load(files(CONFIG_MODULE).joinpath(f"{config_name}.yaml")))["defaults"]
    return {key.removeprefix("optional ").removeprefix("override ") for entry in defaults if isinstance(entry, dict)
            for key in entry}


def check_eval_overrides(overrides: list[str]) -> None:
    """Raise Refused for a ``posbench eval`` override that picks an option of one of training's config groups
    (``scheme=alibi``, ``model=small``): an evaluation scores the run's trained model as it was built; the corpus
    (``data=wikitext2``) is given only with ``pretrained=``. An override Hydra cannot parse is left to composition,
    which names it."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException:  # (composition names it)
        return
    checkpoint = any(o.key_or_group == "pretrained" for o in parsed)
    for o in parsed:
        group = o.key_or_group.split("@")[0]
        if group == "data" and checkpoint:  # a pretrained checkpoint is scored on the corpus given (its tokenizer's)
            continue
        if group == "scheme":
            raise Refused(f"{o.input_line}: the scheme cannot be changed by posbench eval (it scores the trained "
                          "weights of a run or checkpoint); it takes options of the run's or checkpoint's scheme only, "
                          "e.g. scheme.scaling=yarn scheme.factor=4 on a rotary run (see them with: posbench train "
                          "scheme=<name> --cfg job)")
        if group in TRAIN_GROUPS:
            raise Refused(f"{o.input_line}: the {group} cannot be changed by posbench eval (it scores the run's "
                          "trained model); it takes eval.*, device, threads and options of the run's scheme "
                          "(scheme.<option>=…)")
