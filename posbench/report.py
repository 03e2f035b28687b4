"""Results of runs: the per-run record and its files, and the side-by-side table of many runs.

One run writes ``results.json`` (the record: metadata, resolved config and one row per evaluation
length) and ``results.csv`` (one row per length, long format). ``collect`` gathers the records under
folders; ``comparison_table`` prints schemes × evaluation lengths. :class:`ReportCallback` prints that
table and writes ``report.md`` into the sweep folder at the end of every Hydra multirun.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import torch
from hydra.experimental.callback import Callback

log = logging.getLogger("posbench")
FORMAT = 1
CSV_COLUMNS = ["scheme", "model", "data", "train_length", "length", "protocol", "stride", "split", "ppl", "nll",
               "tokens", "train_tokens", "train_seconds", "tokens_per_second", "seed", "torch", "device", "threads"]


def record(config: dict, rows: list[dict], split: str, train_tokens: int, train_seconds: float, device: str,
           threads: int, **extra) -> dict:
    """One run's results record: what ran (scheme, model, data, L, protocol, seed, environment) and ``rows``."""
    e = config["eval"]
    return {"format": FORMAT, "scheme": config["scheme"]["name"], "model": config["model"]["name"],
            "data": config["data"]["name"], "train_length": config["train"]["seq_len"], "lengths": list(e["lengths"]),
            "protocol": e["protocol"], "stride": e["stride"], "split": split, "seed": config["seed"],
            "train_tokens": train_tokens, "train_seconds": round(train_seconds, 2),
            "tokens_per_second": round(train_tokens / train_seconds, 1) if train_seconds else None,
            "torch": torch.__version__, "device": device, "threads": threads, **extra,
            "results": rows, "config": config}


def write_results(out_dir: Path, rec: dict, stem: str = "results") -> None:
    """Write ``<stem>.json`` (the whole record) and ``<stem>.csv`` (one row per evaluation length)."""
    (out_dir / f"{stem}.json").write_text(json.dumps(rec, indent=1))
    with open(out_dir / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for row in rec["results"]:
            w.writerow({**rec, **row})


def _ratio_base(rec: dict) -> dict:
    rows = rec["results"]
    return next((r for r in rows if r["length"] == rec["train_length"]), rows[0])


def run_table(rec: dict) -> str:
    """One run as a table: evaluation length, perplexity, ratio to the perplexity at L, tokens scored."""
    base = _ratio_base(rec)
    lines = [f"{rec['scheme']} (L={rec['train_length']}, {rec['protocol']}, {rec['split']} split)",
             f"{'length':>8} {'ppl':>10} {'ppl/ppl(L)':>11} {'tokens':>8}"]
    lines += [f"{r['length']:>8} {r['ppl']:>10.2f} {r['ppl'] / base['ppl']:>11.2f} {r['tokens']:>8}" for r in rec["results"]]
    return "\n".join(lines)


def collect(folders: list[Path]) -> list[dict]:
    """Every readable ``results.json`` under ``folders`` (recursively), in path order."""
    out = []
    for folder in folders:
        for path in sorted(Path(folder).rglob("results.json")):
            try:
                rec = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                log.warning("skipped %s: unreadable (%s)", path, e)
                continue
            rec["path"] = str(path.parent)
            out.append(rec)
    return out


def comparison_table(records: list[dict]) -> str:
    """Markdown table: one row per run (scheme), one column per evaluation length, cells = perplexity."""
    lengths = sorted({r["length"] for rec in records for r in rec["results"]})
    head = "| scheme | " + " | ".join(str(n) for n in lengths) + " | ppl(max)/ppl(L) |"
    lines = [head, "|" + "---|" * (len(lengths) + 2)]
    for rec in sorted(records, key=lambda r: (r["scheme"], r["seed"])):
        ppl = {r["length"]: r["ppl"] for r in rec["results"]}
        cells = [f"{ppl[n]:.1f}" if n in ppl else "" for n in lengths]
        ratio = ppl[max(ppl)] / _ratio_base(rec)["ppl"]
        lines.append(f"| {rec['scheme']} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    return "\n".join(lines)


class ReportCallback(Callback):
    """Hydra callback: at the end of a multirun, print the comparison table and write ``report.md``."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        records = collect([sweep_dir])
        if not records:
            log.warning("no results under %s: no report written", sweep_dir)
            return
        first = records[0]
        title = (f"Perplexity by evaluation length ({first['protocol']}, {first['data']} {first['split']} split, "
                 f"model={first['model']}, L={first['train_length']})")
        table = comparison_table(records)
        (sweep_dir / "report.md").write_text(f"# {title}\n\n{table}\n")
        print(f"\n{title}\n{table}\n\nreport: {sweep_dir / 'report.md'}", flush=True)
