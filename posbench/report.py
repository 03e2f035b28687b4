"""Results of runs: one run's record and files; many runs folded into tables and plots.

One run writes ``results.json`` (the record: metadata, resolved config, one row per evaluation length
with its per-position NLL) and ``results.csv`` (one row per length); each ``posbench eval`` adds an
``eval-<protocol>-<split>-<n>.json``/``.csv`` pair beside them. ``posbench report FOLDER...`` (and
:class:`ReportCallback` at the end of every multirun) folds the records under the folders into:

* ``report.md`` — per protocol, rows = scheme (and any other swept setting), columns = evaluation
  lengths, cells = perplexity mean ± std over seeds, and ppl(longest)/ppl(L); the settings held fixed;
* ``report.csv`` — the same numbers, long format;
* ``ppl_vs_length.png`` and ``loss_vs_position.png``.

    posbench report multirun/2026-11-21/10-00-00 [--out DIR]
"""

from __future__ import annotations

import csv
import json
import logging
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger("posbench")
FORMAT = 1
CSV_COLUMNS = ["scheme", "model", "data", "train_length", "length", "protocol", "stride", "split", "ppl", "nll",
               "tokens", "train_tokens", "train_seconds", "tokens_per_second", "seed", "torch", "device", "threads"]
IGNORED = ("seed", "eval.", "data.cache_dir", "train.device", "train.threads", "train.log_every", "wandb.")


class ReportError(ValueError):
    """Nothing to report (no folder, or no results in it); the CLI prints it as one line."""


# ---- one run -------------------------------------------------------------------------------------


def record(config: dict, rows: list[dict], split: str, train_tokens: int, train_seconds: float, device: str,
           threads: int, **extra) -> dict:
    """One run's results record: what ran (scheme, model, data, L, protocol, seed, environment) and ``rows``."""
    import torch

    e = config["eval"]
    return {"format": FORMAT, "scheme": config["scheme"]["name"], "model": config["model"]["name"],
            "data": config["data"]["name"], "train_length": config["train"]["seq_len"], "lengths": list(e["lengths"]),
            "protocol": e["protocol"], "stride": e["stride"], "split": split, "seed": config["seed"],
            "train_tokens": train_tokens, "train_seconds": round(train_seconds, 2) if train_seconds else None,
            "tokens_per_second": round(train_tokens / train_seconds, 1) if train_seconds else None,
            "torch": torch.__version__, "device": device, "threads": threads, **extra,
            "results": rows, "config": config}


def write_results(out_dir: Path, rec: dict, stem: str = "results") -> Path:
    """Write ``<stem>.json`` (the whole record) and ``<stem>.csv`` (one row per length); return the JSON path."""
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(rec, indent=1))
    with open(out_dir / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for row in rec["results"]:
            w.writerow({**rec, **row})
    return path


def new_eval_stem(run_dir: Path, protocol: str, split: str) -> str:
    """``eval-<protocol>-<split>-<n>`` with the first n whose file does not exist yet (never overwrites)."""
    n = 1
    while (run_dir / f"eval-{protocol}-{split}-{n}.json").exists():
        n += 1
    return f"eval-{protocol}-{split}-{n}"


def _base(rec: dict) -> dict:
    rows = rec["results"]
    return next((r for r in rows if r["length"] == rec["train_length"]), rows[0])


def run_table(rec: dict) -> str:
    """One run as a table: evaluation length, perplexity, ratio to the perplexity at L, tokens scored."""
    base, stride = _base(rec), f", stride {rec['stride']}" if rec["protocol"] == "sliding" else ""
    lines = [f"{rec['scheme']} (L={rec['train_length']}, {rec['protocol']}{stride}, {rec['split']} split)",
             f"{'length':>8} {'ppl':>10} {'ppl/ppl(L)':>11} {'tokens':>8}"]
    lines += [f"{r['length']:>8} {r['ppl']:>10.2f} {r['ppl'] / base['ppl']:>11.2f} {r['tokens']:>8}" for r in rec["results"]]
    return "\n".join(lines)


# ---- many runs -----------------------------------------------------------------------------------


def collect(folders: list[Path]) -> tuple[list[dict], list[str]]:
    """Every usable record under ``folders``, and one line per run skipped with the reason.

    Skipped: a run folder with no results yet (still running, or stopped before evaluation), a run
    marked failed, a broken results file, a run whose train length L differs from the most common L.
    Raises ReportError for a missing folder or when nothing usable is found.
    """
    records, skipped = [], []
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise ReportError(f"{str(folder)!r} is not a folder; give run or sweep folders")
        runs = {p.parent.parent for p in folder.rglob(".hydra/config.yaml")} | {p.parent for p in folder.rglob("results.json")}
        for run in sorted(runs):
            files = sorted([*run.glob("results.json"), *run.glob("eval-*.json")])
            if not files:
                skipped.append(f"{run}: no results yet (still running, or stopped before evaluation)")
            for path in files:
                try:
                    rec = json.loads(path.read_text())
                except (OSError, ValueError):
                    rec = None
                if isinstance(rec, dict) and rec.get("status") == "failed":
                    skipped.append(f"{path}: failed ({rec.get('error')})")
                    continue
                if not _well_formed(rec):
                    skipped.append(f"{path}: broken results file")
                    continue
                rec["path"] = str(path)
                records.append(rec)
    if records:
        common = Counter(r["train_length"] for r in records).most_common(1)[0][0]
        skipped += [f"{r['path']}: train length L={r['train_length']} differs from L={common} of the other runs"
                    for r in records if r["train_length"] != common]
        records = [r for r in records if r["train_length"] == common]
    if not records:
        raise ReportError(f"no results in {', '.join(map(str, folders))}" + (f" ({len(skipped)} runs skipped)" if skipped else ""))
    return records, skipped


RECORD_KEYS = ("format", "scheme", "train_length", "protocol", "stride", "split", "seed", "config", "results")
ROW_KEYS = ("length", "ppl", "nll", "nll_by_position")


def _well_formed(rec) -> bool:
    """A results record of this format with every key the report reads."""
    return (isinstance(rec, dict) and all(k in rec for k in RECORD_KEYS) and rec["format"] == FORMAT
            and isinstance(rec["config"], dict) and isinstance(rec["results"], list) and len(rec["results"]) > 0
            and all(isinstance(r, dict) and all(k in r for k in ROW_KEYS) for r in rec["results"]))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": json.dumps(v)})
    return out


def settings(records: list[dict]) -> tuple[list[str], dict]:
    """(swept keys, fixed settings) of the records' configs. A key is swept when it differs between two runs
    of the same scheme, or is the scheme itself; seeds, evaluation and bookkeeping keys never count."""
    flats = [_flat(r["config"]) for r in records]
    keys = sorted(set().union(*flats))
    by_scheme = defaultdict(list)
    for f in flats:
        by_scheme[f["scheme.name"]].append(f)
    swept = ["scheme.name"] + [k for k in keys if not k.startswith(IGNORED) and k != "scheme.name" and
                               any(len({f.get(k) for f in group}) > 1 for group in by_scheme.values())]
    fixed = {k: flats[0][k] for k in keys if not k.startswith(("seed", "scheme.")) and len({f.get(k) for f in flats}) == 1
             and flats[0][k] not in ("null", "[]")}
    return swept, fixed


def _label(flat: dict, swept: list[str]) -> str:
    return ", ".join(flat[k].strip('"') if k == "scheme.name" else f"{k}={flat[k]}" for k in swept)


def fold(records: list[dict]) -> list[dict]:
    """Long-format rows: one per (protocol, stride, split, setting, length) with ppl mean, std and seed count."""
    swept, _ = settings(records)
    cells = defaultdict(list)
    for rec in records:
        key = (rec["protocol"], rec["stride"], rec["split"], _label(_flat(rec["config"]), swept))
        for r in rec["results"]:
            cells[key + (r["length"],)].append((rec["seed"], r["ppl"], r["nll"]))
    rows = []
    for (protocol, stride, split, setting, length), vals in sorted(cells.items(), key=lambda kv: str(kv[0])):
        by_seed = {seed: (p, n) for seed, p, n in vals}  # a re-evaluation of the same seed counts once
        ppl = [p for p, _ in by_seed.values()]
        rows.append({"protocol": protocol, "stride": stride, "split": split, "setting": setting, "length": length,
                     "ppl_mean": statistics.fmean(ppl), "ppl_std": statistics.stdev(ppl) if len(ppl) > 1 else 0.0,
                     "nll_mean": statistics.fmean(n for _, n in by_seed.values()), "seeds": len(ppl)})
    return rows


def tables(rows: list[dict], train_length: int) -> str:
    """Markdown tables, one per (protocol, stride, split): settings × lengths, ppl mean ± std, ppl(max)/ppl(L)."""
    out = []
    for group in sorted({(r["protocol"], r["stride"], r["split"]) for r in rows}, key=str):
        sub = [r for r in rows if (r["protocol"], r["stride"], r["split"]) == group]
        lengths = sorted({r["length"] for r in sub})
        protocol, stride, split = group
        title = f"{protocol}{f' (stride {stride})' if protocol == 'sliding' else ''}, {split} split"
        lines = [f"### {title}", "", "| | " + " | ".join(str(n) for n in lengths) + f" | ppl({lengths[-1]})/ppl(L) |",
                 "|---" * (len(lengths) + 2) + "|"]
        for setting in dict.fromkeys(r["setting"] for r in sub):
            mine = {r["length"]: r for r in sub if r["setting"] == setting}
            cells = [(f"{mine[n]['ppl_mean']:.1f}" + (f" ± {mine[n]['ppl_std']:.1f}" if mine[n]["seeds"] > 1 else ""))
                     if n in mine else "" for n in lengths]
            base = mine.get(train_length, mine[min(mine)])
            lines.append(f"| {setting} | " + " | ".join(cells) + f" | {mine[max(mine)]['ppl_mean'] / base['ppl_mean']:.2f} |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _first_protocol(rows: list[dict]) -> tuple[str, str, str]:
    """The (protocol, stride, split) that plots show: nonoverlapping when present."""
    return min({(r["protocol"] != "nonoverlapping", r["protocol"], str(r["stride"]), r["split"]) for r in rows})[1:]


def plots(records: list[dict], rows: list[dict], out: Path, train_length: int) -> dict[str, Path]:
    """ppl_vs_length.png (log2 x, one line per setting, ± std bands, a line at L) and loss_vs_position.png
    (NLL by token position at the longest length, one line per setting, a line at L); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    protocol = _first_protocol(rows)
    sub = [r for r in rows if (r["protocol"], str(r["stride"]), r["split"]) == protocol]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    settings_ = sorted({r["setting"] for r in rows})
    colour = {name: f"C{i % 10}" for i, name in enumerate(settings_)}  # one colour per setting in both plots
    for setting in [name for name in settings_ if any(r["setting"] == name for r in sub)]:
        pts = sorted((r["length"], r["ppl_mean"], r["ppl_std"]) for r in sub if r["setting"] == setting)
        xs, ys, sd = zip(*pts)
        ax.plot(xs, ys, marker="o", label=setting, color=colour[setting])
        ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)], alpha=0.2, color=colour[setting])
    ax.set(xscale="log", yscale="log", xlabel="evaluation length (tokens)", ylabel="perplexity",
           title=f"Perplexity vs evaluation length ({protocol[0]}, {protocol[2]})")
    ax.set_xscale("log", base=2)
    ax.axvline(train_length, color="grey", linestyle="--", label=f"L = {train_length}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ppl_vs_length.png", dpi=110)
    plt.close(fig)

    swept, _ = settings(records)
    curves = defaultdict(dict)
    for rec in records:
        if (rec["protocol"], str(rec["stride"]), rec["split"]) != protocol:
            continue
        longest = max(rec["results"], key=lambda r: r["length"])
        curves[(_label(_flat(rec["config"]), swept), longest["length"])][rec["seed"]] = longest["nll_by_position"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (setting, length), by_seed in sorted(curves.items()):
        runs = list(by_seed.values())  # one curve per seed, re-evaluations of a seed counted once
        edges = runs[0]["position"]
        xs = [(a + b + 1) / 2 for a, b in zip(edges, [*edges[1:], length])]  # bin centres, 1-based positions
        ax.plot(xs, [statistics.fmean(v) for v in zip(*(r["nll"] for r in runs))], label=f"{setting} ({length})", color=colour[setting])
    ax.set(xscale="log", xlabel="token position in the window (1-based)", ylabel="NLL (nats/token)",
           title="Loss by position at the longest evaluation length")
    ax.axvline(train_length, color="grey", linestyle="--", label=f"L = {train_length}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loss_vs_position.png", dpi=110)
    plt.close(fig)
    return {"ppl_vs_length": out / "ppl_vs_length.png", "loss_vs_position": out / "loss_vs_position.png"}


def write_report(folders: list[Path], out: Path) -> tuple[str, list[dict], dict[str, Path]]:
    """Collect, fold, write report.md / report.csv / both PNGs into ``out``; return (tables, rows, images).

    Raises ReportError when there is nothing to report."""
    records, skipped = collect(folders)
    for line in skipped:
        log.warning("skipped %s", line)
    rows = fold(records)
    train_length = records[0]["train_length"]
    _, fixed = settings(records)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "report.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["setting", "protocol", "stride", "split", "length", "ppl_mean", "ppl_std", "nll_mean", "seeds"])
        w.writeheader()
        w.writerows(rows)
    images = plots(records, rows, out, train_length)
    seeds = sorted({r["seed"] for r in records})
    table_text = tables(rows, train_length)
    text = (f"# posbench report: perplexity by evaluation length (L = {train_length})\n\n"
            f"{len(records)} results from runs with seeds {seeds}; cells are mean ± std over seeds.\n\n"
            f"{table_text}\n\n![ppl vs length](ppl_vs_length.png)\n![loss vs position](loss_vs_position.png)\n\n"
            "## Settings held fixed\n\n" + "\n".join(f"- `{k}` = {v}" for k, v in fixed.items()) + "\n"
            + ("\n## Skipped\n\n" + "\n".join(f"- {s}" for s in skipped) + "\n" if skipped else ""))
    (out / "report.md").write_text(text)
    return table_text, rows, images


def ppl_series(rows: list[dict]) -> dict[str, tuple[list, list]]:
    """{setting: (lengths, mean ppl)} of the first protocol in ``rows`` (nonoverlapping when present)."""
    first = _first_protocol(rows)
    series = defaultdict(lambda: ([], []))
    for r in sorted(rows, key=lambda r: r["length"]):
        if (r["protocol"], str(r["stride"]), r["split"]) == first:
            series[r["setting"]][0].append(r["length"])
            series[r["setting"]][1].append(r["ppl_mean"])
    return dict(series)


class ReportCallback(Callback):
    """Hydra callback: at the end of every multirun, write the report into the sweep folder, print its
    tables, and log the perplexity-vs-length chart and the PNGs to a wandb run of the sweep's group."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from posbench.tracking import Tracker

        sweep = Path(config.hydra.sweep.dir)
        try:
            table_text, rows, images = write_report([sweep], sweep)
        except ReportError as e:
            log.warning("no report: %s", e)
            return
        print(f"\n{table_text}\n\nreport: {sweep / 'report.md'}", flush=True)
        w = config.wandb
        tracker = Tracker(w.enabled, sweep, w.project, w.entity, name="report", group=sweep_group(sweep), job_type="report")
        tracker.log_report(ppl_series(rows), images)
        tracker.finish()


def sweep_group(sweep_dir: Path) -> str:
    """The wandb group of a sweep: its folder's last two parts (``2026-11-21/10-00-00``)."""
    return "/".join(Path(sweep_dir).parts[-2:])
