"""Redraw the perplexity plots of docs/results.md from its own tables, with the report's plotting code.

    python scripts/docs_plots.py                           # docs/ppl_vs_length.png, zoo_, tricks_, hybrids_…
    python scripts/docs_plots.py --loss <run or sweep> …   # and docs/loss_vs_position.png from those runs' records

Each figure is drawn from the markdown table it stands beside (cells ``121.2 ± 1.9 ★``: the mean and the standard
deviation over seeds; a one-seed cell has no band), so a plot shows the numbers printed and nothing else, and follows
the report's rules (posbench/report/plots.py: each line's label at its end, 4 to 8 round values on the y axis). The
per-position losses are not in any table: ``--loss`` draws them from run records with ``posbench report``'s code.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from posbench.report import compare, plots
from posbench.report.records import collect
from posbench.report.render import table_title

DOCS = Path(__file__).resolve().parents[1] / "docs"
# {image: (the text of the line that opens the table's paragraph, the panel's title)}
FIGURES = {
    "ppl_vs_length.png": ("**Reference numbers: three seeds.**",
                          "experiment=compare: nonoverlapping, validation split (whole), mean of 3 seeds ± std"),
    "zoo_ppl_vs_length.png": ("`posbench train -m experiment=zoo` trains every registered scheme",
                              "experiment=zoo: nonoverlapping, validation split (whole), seed 0"),
    "tricks_ppl_vs_length.png": ("NoPE × randomized positions is not a cell",
                                 "experiment=tricks: nonoverlapping, validation split (whole), seed 0"),
    "hybrids_ppl_vs_length.png": ("**Perplexity** (`posbench report` over both sweeps",
                                  "experiment=hybrids: nonoverlapping, validation split (whole), 1 or 3 seeds (± std)"),
}
CELL = re.compile(r"\*{0,2}([\d.]+)(?: ± ([\d.]+))?")  # "**121.2 ± 1.9 ★**" → 121.2, 1.9


def table_after(text: str, opening: str) -> list[list[str]]:
    """The cells of the first markdown table after the line of ``text`` that starts with ``opening``, header first.
    Raises ValueError when there is no such line or no table after it."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(opening)), None)
    if start is None:
        raise ValueError(f"no line starts with {opening!r} in docs/results.md")
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        if not set(line) <= set("|-: "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def rows_of(table: list[list[str]]) -> tuple[list[dict], dict[str, str]]:
    """(rows as posbench.report.plots.draw_ppl takes them, {setting: label}) of a table whose header names its
    evaluation lengths (``128 (= L)``, ``256``, …; the ``(= L)`` one is the train length)."""
    header, body = table[0], table[1:]
    columns = {j: int(h.split()[0]) for j, h in enumerate(header) if h.split() and h.split()[0].isdigit()}
    train = next(int(h.split()[0]) for h in header if "(= L)" in h)
    rows, labels = [], {}
    for i, cells in enumerate(body):
        setting = f"{i:02d}"
        labels[setting] = cells[0].replace("`", "")
        for j, length in columns.items():
            ppl, std = CELL.match(cells[j]).groups()
            rows.append({"setting": setting, "length": length, "ppl": float(ppl), "ppl_std": float(std or 0),
                         "train_length": train, "origin_length": train})
    return rows, labels


def loss(folders: list[Path]) -> Path:
    """docs/loss_vs_position.png from the records under ``folders`` (their first evaluation setting)."""
    records, _ = collect(folders)
    rows = compare.fold(records)
    first = [r for r in rows if r["table"] == 1]
    title = f"1. {table_title(first[0])}"
    return plots.draw_loss(DOCS, [(title, first, compare.position_curves(records, rows, 1))], compare.labels(records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loss", nargs="+", type=Path, metavar="FOLDER",
                        help="run or sweep folders whose records draw docs/loss_vs_position.png")
    args = parser.parse_args()
    text = (DOCS / "results.md").read_text()
    for name, (opening, title) in FIGURES.items():
        rows, labels = rows_of(table_after(text, opening))
        print(plots.draw_ppl(DOCS, [(title, rows)], labels, name))
    if args.loss:
        print(loss(args.loss))


if __name__ == "__main__":
    main()
