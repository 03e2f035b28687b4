"""One run's results: its record and the files it is written to (docs/design.md §7).

A finished ``posbench train`` writes ``results.json`` (the record) and ``results.csv`` (one row per evaluation
length, and per passkey probe length, :data:`CSV_COLUMNS`) into its run folder; each ``posbench eval`` adds an
``eval-<label>-<protocol>-<split>-<n>.json``/``.csv`` pair beside them (:func:`new_eval_stem`). The record
(format :data:`FORMAT`) holds what ran — scheme, variant label, model, data, train length L, evaluation lengths,
protocol, stride, split, seed, tokens and time trained, environment, and the fields its caller adds
(``scored_split``, ``status``, ``world_size``, …) — then ``results``, one row per evaluation length with its
per-position and per-window NLL, and ``config``, the resolved config. A failed run's record is ``{format,
status: "failed", error, step, results: [], config}``. ``posbench report`` reads these records (posbench/report/records.py).

    rec = record(config, rows, "rope", split="validation", train_tokens=n, train_seconds=s, device="cpu", threads=4)
    write_results(run_dir, rec)                                  # results.json, results.csv
    write_results(run_dir, rec, new_eval_stem(run_dir, rec["label"], rec["protocol"], rec["split"]))
    print(run_table(rec))
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import re
from collections import defaultdict
from pathlib import Path

import torch

from posbench.attention import remap
from posbench.attention.temperature import BETA, default_length
from posbench.attention.windows import Window
from posbench.evaluation import context, retrieval
from posbench.schemes import SCHEMES, variant_label

SUPERSEDED = "superseded"  # a run folder's subfolder of an earlier model's outputs (resume=never); not reported
FORMAT = 4  # 4: a rotary scheme records yarn_ramp; 3: config.scheme holds the scheme's own options only; 2: rows
READABLE = (1, 2, 3, 4)  # carry window_nll / window_tokens. Older records are read too (posbench.config.upgrade.upgrade)
CSV_COLUMNS = ["scheme", "model", "data", "train_length", "length", "protocol", "stride", "split", "scored_split", "ppl",
               "nll", "tokens", "train_tokens", "train_seconds", "tokens_per_second", "seed", "torch", "device", "threads",
               "context_diff", "context_ci_low", "context_ci_high",  # context_*: eval.probes=[context], lengths past L
               "passkey_trials", "passkey_correct", "passkey_accuracy", "passkey_ci_low", "passkey_ci_high",
               "passkey_gain",  # passkey_*: eval.probes=[passkey], its probe lengths (exact match, Wilson 95% interval)
               "passkey_transfer_correct", "passkey_transfer_accuracy", "passkey_transfer_ci_low",
               "passkey_transfer_ci_high", "passkey_transfer_gain",  # the same windows with the transfer control's keys
               "checkpoint", "checkpoint_sha256", "quantisation"]  # a pretrained checkpoint's (posbench eval pretrained=)
PASSKEY_CSV = {"trials": "n", "correct": "correct", "accuracy": "accuracy", "ci_low": "ci_low", "ci_high": "ci_high",
               "gain": "gain", **{f"transfer_{k}": f"transfer_{k}" for k in ("correct", "accuracy", "ci_low", "ci_high",
                                                                            "gain")}}
# (results.csv's passkey_<column> → posbench.evaluation.retrieval.run_cells' key)


def record(config: dict, rows: list[dict], label: str, split: str, train_tokens: int, train_seconds: float,
           device: str, threads: int, **extra) -> dict:
    """One run's results record: what ran (scheme, its variant ``label``, model, data, L, protocol, seed,
    environment) and ``rows`` (as :func:`posbench.evaluation.perplexity.evaluate` returns them). ``extra`` adds fields, e.g.
    ``scored_split``: the split whose files were scored when the corpus lacks ``split`` (the report reads a missing
    one as ``split``)."""
    e = config["eval"]
    return {"format": FORMAT, "scheme": config["scheme"]["name"], "label": label,
            "model": config["model"]["name"],
            "data": config["data"]["name"], "train_length": config["train"]["seq_len"], "lengths": list(e["lengths"]),
            "protocol": e["protocol"], "stride": e["stride"], "split": split, "seed": config["seed"],
            "train_tokens": train_tokens, "train_seconds": round(train_seconds, 2) if train_seconds else None,
            "tokens_per_second": round(train_tokens / train_seconds, 1) if train_seconds else None,
            "torch": torch.__version__, "device": device, "threads": threads, **extra,
            "results": rows, "config": config}


def run_label(config: dict, lineage: dict | None = None, steps: bool = True) -> str:
    """A run's label in results, file names, wandb and report rows: the scheme's variant label
    (:func:`posbench.schemes.variant_label`: ``rope``, ``rope+yarn×4``), then, for a run started from a parent's
    weights (``lineage``: posbench/training/lineage.py), what it did from there: ``ft<L>×<steps>`` (fine-tuned at length L
    for that many steps; ×0: the parent's weights evaluated as they are), and the parent's scheme when it changed
    (``rope→nope ft512×200``), after the name of a pretrained parent (``SmolLM2-135M rope+yarn×4 ft32768×200``).
    ``steps=False`` leaves the step count out: the method (``rope+yarn×4 ft512``).
    Hybrid layers follow the scheme's label (:func:`layers_label`: ``rope+LLLG(w32, G=nope)``), then training-side
    tricks: randomized positions (``+rand<M>``, ``train.random_positions``), PoSE (``+pose<L_t>``, ``train.pose``)
    and length-dependent attention scaling (``+log_n``, ``+ssmax``, ``model.attn_scale``): ``alibi+rand1024``; last, an
    evaluation's training-free extension (:func:`remap_label`: ``rope@rerope(w16)``)."""
    label = variant_label(config["scheme"]) + layers_label(config) + tricks_label(config) + remap_label(config)
    if not lineage:
        return label
    changed = f"{lineage['scheme']}→" if lineage.get("scheme") not in (None, config["scheme"]["name"]) else ""
    origin = f"{lineage['pretrained']['name']} " if lineage.get("pretrained") else ""  # a pretrained checkpoint's
    return f"{origin}{changed}{label} ft{config['train']['seq_len']}" + (f"×{config['train']['steps']}" if steps else "")


def applied(config: dict, trained: dict, lineage: dict | None = None) -> tuple[str, str] | None:
    """What an evaluation of a trained run applied on top of it: other scheme options or another temperature
    (``posbench eval … scheme.scaling=yarn``, ``… model.attn_scale=floor_log``), as (the trained run's label with this
    evaluation's remap, what the options add: ``yarn×4``, ``floor_log``, or the whole new variant where it does not
    extend the trained one: ``rope+yarn×2.5``); None where the scheme and the temperature are the trained ``config``'s."""
    base, new = variant_label(trained["scheme"]), variant_label(config["scheme"])
    parts = [new[len(base) + 1:] if new.startswith(base + "+") else new] if new != base else []
    temperature = temperature_label(config)
    if temperature != temperature_label(trained):
        parts.append(temperature[1:] or "attn_scale=none")
    if not parts:
        return None
    remapped = {**trained, "eval": config.get("eval") or {}}  # the trained run, with this evaluation's remap
    return run_label(remapped, lineage), "+".join(parts)


def evaluation_label(config: dict, trained: dict, lineage: dict | None = None) -> str:
    """One evaluation's label, the same on the console, in its eval file's name, wandb and the report: the run label
    of ``config`` (:func:`run_label`), or, where it applied options to the trained run (:func:`applied`),
    ``rope@self_extend(W32,G32) (log_n_clipped at eval)``."""
    done = applied(config, trained, lineage)
    return "{} ({} at eval)".format(*done) if done else run_label(config, lineage)


def checkpoint_name(source: str) -> str:
    """A pretrained checkpoint's name in labels and folder names: a GGUF file's stem without its quantisation
    (``SmolLM2-135M-Instruct.Q4_1.gguf`` → ``SmolLM2-135M-Instruct``), a folder's name, a Hub id's model name
    (``HuggingFaceTB/SmolLM2-135M`` → ``SmolLM2-135M``)."""
    path = Path(str(source).rstrip("/"))
    name = path.stem if path.suffix == ".gguf" else path.name
    return re.sub(r"[.-](I?Q\d\w*|F16|BF16|F32)$", "", name, flags=re.IGNORECASE) or name


def pretrained_label(name: str, config: dict, trained: dict) -> str:
    """An evaluation of a pretrained checkpoint's label: its ``name`` (:func:`checkpoint_name`), then what the
    evaluation applied to it, a remap and other scheme options or a temperature (:func:`applied`):
    ``SmolLM2-135M-Instruct (self_extend(W1024,G8) at eval)``, ``SmolLM2-135M-Instruct (yarn×4 at eval)``."""
    remapped = remap_label(config)[1:]
    done = applied(config, {**trained, "eval": config.get("eval") or {}})
    parts = [p for p in (remapped, done[1] if done else "") if p]
    return f"{name} ({'+'.join(parts)} at eval)" if parts else name


def tricks_label(config: dict) -> str:
    """``+rand<M>``, ``+pose<L_t>`` (``+pose<L_t>n<N>`` for N chunks other than 2), then the attention temperature
    (:func:`temperature_label`): ``alibi+rand1024``, ``rope+floor_log_n-G``; "" for none (older records lack the keys:
    none)."""
    train = config.get("train") or {}
    pose = f"+pose{train['pose']}" + (f"n{train['pose_chunks']}" if train.get("pose_chunks", 2) != 2 else "") \
        if train.get("pose") else ""
    return (f"+rand{train['random_positions']}" if train.get("random_positions") else "") + pose + temperature_label(config)


def remap_label(config: dict) -> str:
    """``@<method>(<parameters>)`` for an evaluation with a training-free extension (``eval.remap``,
    posbench/attention/remap.py): ``rope@self_extend(W32,G32)``; "" for none (older records lack the key: none)."""
    e = config.get("eval") or {}
    options = e.get("remap_options") or {}
    method = e.get("remap") or "none"
    if method == "none":
        return ""
    return "@" + remap.Remap(method, **{k: options[k] for k in remap.PARAMETERS[method]}).label()


def temperature_label(config: dict) -> str:
    """The attention temperature's part of a label (``model.attn_scale``: ``+log_n``, ``+ssmax``, ``+floor_log``,
    ``+floor_log_n``, ``+log_n_clipped``), followed by its ``model.scale_length`` where that is not its default
    (``+log_n256``), ``[beta=<β>]`` where β is not 0.1, and ``-G`` when it scales the G layers only
    (``model.scale_layers=global``): ``+floor_log_n-G``; "" for none."""
    seq_len, model = (config.get("train") or {}).get("seq_len"), config.get("model") or {}
    scale, length = model.get("attn_scale") or "none", model.get("scale_length")
    if scale == "none":
        return ""
    default = default_length(scale, seq_len) if seq_len else None
    beta = model.get("scale_beta", BETA)
    return (f"+{scale}" + (str(length) if length not in (None, default) else "")
            + (f"[beta={beta:g}]" if beta != BETA else "") + ("-G" if model.get("scale_layers") == "global" else ""))


def layers_label(config: dict) -> str:
    """What a model's layers add to its label: a pattern with L layers as ``+<pattern>(<parts>)``, the parts its
    window (``w32`` sliding, ``c32`` chunked), its global scheme (``G=nope``; ``G=rope[base=1e+06]``: the global
    scheme's variant label and its options that differ from their defaults), QK-norm (``qknorm``; ``0``: without a
    gain; ``-L``: on the L layers only) and sinks (``sink``): ``rope+LLLG(c32, G=nope, qknorm0-L)``; without L layers,
    the parts alone (``rope+qknorm+sink``); "" for today's default model (older records lack the keys: "")."""
    model, seq_len = config.get("model") or {}, (config.get("train") or {}).get("seq_len")
    pattern, parts = model.get("layer_pattern") or "G", []
    if model.get("window"):
        parts.append(Window(model["window"], model.get("window_kind") or "sliding").label())
    if model.get("global_scheme"):
        parts.append(f"G={_global_label(model['global_scheme'], seq_len)}")
    if (model.get("qk_norm") or "none") != "none":
        parts.append("qknorm" + ("" if model.get("qk_norm_weight", True) else "0")
                     + ("-L" if model.get("qk_norm_layers") == "local" else ""))
    if model.get("attn_sink"):
        parts.append("sink")
    if "L" in pattern:
        return f"+{pattern}" + (f"({', '.join(parts)})" if parts else "")
    return "".join(f"+{p}" for p in parts)


def _global_label(section, seq_len: int | None) -> str:
    """A global scheme section's label: its variant label and, in brackets, its options that differ from its Config's
    defaults filled from ``seq_len`` (a name alone: the name)."""
    section = {"name": section} if isinstance(section, str) else dict(section)
    label = variant_label(section)
    try:
        defaults = SCHEMES[section["name"]].make_config()
        if seq_len:
            defaults.fill(seq_len)
        default = dataclasses.asdict(defaults)
    except (KeyError, ValueError, TypeError):
        return label
    differ = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in section.items()  # (not those the
              if k != "name" and k in default and v != default[k]  # variant label states already)
              and variant_label({**section, k: default[k]}) == label]
    return label + (f"[{','.join(differ)}]" if differ else "")


def write_results(out_dir: Path, rec: dict, stem: str = "results") -> Path:
    """Write ``<stem>.json`` (the whole record) and ``<stem>.csv`` (one row per length, in length order, with the
    context probe's difference and interval at the lengths it measured, and the passkey probe's exact-match accuracy
    and Wilson interval at its probe lengths, its own keys' and its transfer control's: a length probed but not
    scored for perplexity (``eval.passkey.lengths``) gets a row of its own with empty perplexity cells), and, for a
    pretrained checkpoint, its source, the sha256 of its weights and its quantisation; return the JSON path."""
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(rec, indent=1))
    probed = defaultdict(dict)
    for r in (rec.get("context") or {}).get("rows", []):
        probed[r["length"]].update({f"context_{k}": r[k] for k in ("diff", "ci_low", "ci_high")})
    for c in retrieval.run_cells(rec["passkey"]) if rec.get("passkey") else []:
        probed[c["length"]].update({f"passkey_{k}": c[v] for k, v in PASSKEY_CSV.items()})
    rows = {row["length"]: row for row in rec["results"]}
    checkpoint = rec.get("pretrained") or {}
    checkpoint = {"checkpoint": checkpoint.get("source"), "checkpoint_sha256": checkpoint.get("sha256"),
                  "quantisation": checkpoint.get("quantisation")}
    with open(out_dir / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for length in sorted(rows.keys() | probed.keys()):
            w.writerow({**rec, **checkpoint, "length": length, **rows.get(length, {}), **probed[length]})
    return path


def new_eval_stem(run_dir: Path, label: str, protocol: str, split: str) -> str:
    """``eval-<label>-<protocol>-<split>-<n>`` (:func:`file_label`: ``rope+yarnx4_ft512x200``) with the first n not
    yet taken, claimed by creating ``<stem>.json`` exclusively: two evaluations started together get different
    files, and no file is ever overwritten by another evaluation. The caller then writes the claimed (empty) file."""
    base = f"eval-{file_label(label)}-{protocol}-{split}"
    for n in itertools.count(1):
        try:
            with open(run_dir / f"{base}-{n}.json", "x"):
                return f"{base}-{n}"
        except FileExistsError:
            continue


def file_label(label: str) -> str:
    """A run label as a file name's part: ``×`` written ``x``, ``→`` written ``-to-``, whitespace ``_``, so that a
    fine-tuned run's ``rope→nope ft512×200`` names ``rope-to-nope_ft512x200`` (no space to quote in a shell); a hybrid's
    brackets and commas ``_``, ``=`` ``-``: ``rope+LLLG(w32, G=nope)`` names ``rope+LLLG_w32_G-nope``."""
    for old, new in (("×", "x"), ("→", "-to-"), (", ", " "), (",", " "), ("(", " "), ("[", " "), (")", ""), ("]", ""),
                     ("=", "-")):
        label = label.replace(old, new)
    return "_".join(label.split())


def _base(rec: dict) -> dict:
    rows = rec["results"]
    return next((r for r in rows if r["length"] == rec["train_length"]), rows[0])


def run_table(rec: dict) -> str:
    """One run as a table: evaluation length, perplexity, ratio to the perplexity at L, tokens scored; then the
    passkey probe's table (posbench/evaluation/retrieval.py) and the context probe's (posbench/evaluation/context.py)
    when the record has them."""
    base, stride = _base(rec), f", stride {rec['stride']}" if rec["protocol"] == "sliding" else ""
    lines = [f"{rec.get('label', rec['scheme'])} (L={rec['train_length']}, {rec['protocol']}{stride}, {split_text(rec)})",
             f"{'length':>8} {'ppl':>10} {'ppl/ppl(L)':>11} {'tokens':>8}"]
    lines += [f"{r['length']:>8} {r['ppl']:>10.2f} {r['ppl'] / base['ppl']:>11.2f} {r['tokens']:>8}" for r in rec["results"]]
    if rec.get("passkey"):
        lines += ["", retrieval.table(rec["passkey"])]
    if rec.get("context"):
        lines += ["", context.table(rec["context"])]
    return "\n".join(lines)


def split_text(r: dict) -> str:
    """``validation split``, or ``test split (scored the validation files: the corpus has no test files)``."""
    scored = r.get("scored_split") or r["split"]
    return f"{r['split']} split" + (f" (scored the {scored} files: the corpus has no {r['split']} files)"
                                    if scored != r["split"] else "")
