"""Pictures of bench records: a PNG beside each record that has one (matplotlib, the
``bench`` extra; never a runtime dependency).

    .venv/bin/python bench/plots.py [--records docs/benchmarks]   # redraw from the latest records

- ``adaptive-*.png``: tokens/s against concurrent streams per mode, adaptive and at a
  fixed k;
- ``heads-*.png``: each proposer's acceptance per draft position, at its longest k;
- ``tasks-*.png``: the task suite, speed over target-only per mode and kind of task, at
  each stream count, in-process and served.

``bench/record.py`` draws a record's picture when it writes the record, so a picture
always shows the numbers its record holds.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHES = ("adaptive", "heads", "tasks")

Series = tuple[str, list[tuple[float, float]]]


def output_lines(record: Path) -> list[str]:
    text = record.read_text()
    return text.split("## Output", 1)[1].split("```text", 1)[1].split("```", 1)[0].splitlines()


def speed_series(record: Path) -> list[Series]:
    """``streams  none  <mode> k=4  <mode> adapt ...`` rows: one series per column."""
    lines = output_lines(record)
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("streams"))
    columns = re.findall(r"none|\w+ k=\d+|\w+ adapt", lines[header])
    rows = []
    for line in lines[header + 1:]:
        cells = line.split()
        if not cells or not cells[0].isdigit():
            break
        rows.append((float(cells[0]), [float(v) for v in re.findall(r"(?<![(\d.])(\d+\.\d+)(?!x)", line)]))
    return [(name, [(streams, values[i]) for streams, values in rows if i < len(values)])
            for i, name in enumerate(columns)]


def acceptance_series(record: Path) -> list[Series]:
    """Each mode's row at its longest k: acceptance per position."""
    longest: dict[str, tuple[int, list[float]]] = {}
    for line in output_lines(record):
        match = re.match(r"^(\w+)\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+[\d.]+x\s+([\d. ]+?)\s+(yes|no)$", line)
        if match:
            k = int(match.group(2))
            if k >= longest.get(match.group(1), (0, []))[0]:
                longest[match.group(1)] = (k, [float(v) for v in match.group(3).split()])
    return [(f"{mode} (k={k})", [(i + 1, a) for i, a in enumerate(values)]) for mode, (k, values) in longest.items()]


def task_tables(record: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Each table's title ("1 stream", "32 streams", "1 stream, served") -> kind -> mode ->
    speed over target-only, in the record's order."""
    tables: dict[str, dict[str, dict[str, float]]] = {}
    title = None
    for line in output_lines(record):
        header = re.search(r"(\d+) stream\(s\)", line)
        if header:
            streams = int(header.group(1))
            title = f"{streams} stream{'s' if streams > 1 else ''}"
            continue
        if line.startswith("task suite served"):
            title = "1 stream, served"
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if title is not None and len(cells) == 8 and cells[6].endswith("x"):
            tables.setdefault(title, {}).setdefault(cells[0], {})[cells[1]] = float(cells[6][:-1])
    return tables


def draw(record: Path) -> Path | None:
    """The record's picture beside it (``<record>.png``); None for a bench without one."""
    bench = record.name.rsplit("-", 3)[0]
    if bench not in BENCHES:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    if bench == "tasks":
        tables = task_tables(record)
        figure, axes = plt.subplots(1, len(tables), figsize=(6 * len(tables), 4.2), squeeze=False)
        for axis, (title, kinds) in zip(axes[0], tables.items()):
            modes = list(next(iter(kinds.values())))
            width = 0.8 / len(kinds)
            for i, (kind, speeds) in enumerate(kinds.items()):
                axis.bar([m + i * width for m in range(len(modes))], [speeds.get(mode, 0) for mode in modes],
                         width, label=kind)
            axis.axhline(1.0, color="black", linewidth=0.8)
            axis.set_xticks([m + width * (len(kinds) - 1) / 2 for m in range(len(modes))], modes, rotation=30,
                            ha="right")
            axis.set_title(title)
            axis.set_ylabel("speed over target-only")
            axis.legend(fontsize=8)
        figure.suptitle(f"Task suite, greedy, adaptive ({record.name})")
    else:
        figure, axis = plt.subplots(figsize=(7.5, 4.5))
        series = speed_series(record) if bench == "adaptive" else acceptance_series(record)
        colours = {}
        for name, points in series:
            mode = name.split(" ")[0]
            colours.setdefault(mode, f"C{len(colours)}")
            axis.plot([x for x, _ in points], [y for _, y in points], marker="o", color=colours[mode],
                      linestyle="--" if " k=" in name else "-", label=name)
        if bench == "adaptive":
            axis.set_xscale("log", base=2)
            ticks = sorted({x for _, points in series for x, _ in points})
            axis.set_xticks(ticks, [f"{x:g}" for x in ticks])
            axis.set(xlabel="concurrent streams", ylabel="tokens/s",
                     title=f"Speed against streams, dashed: fixed k ({record.name})")
        else:
            axis.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1),
                     title=f"Acceptance per draft position ({record.name})")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    path = record.with_suffix(".png")
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=Path, default=ROOT / "docs/benchmarks")
    args = parser.parse_args(argv)
    for bench in BENCHES:
        found = sorted(args.records.glob(f"{bench}-*.md"))
        if found:
            print(f"wrote {draw(found[-1])}")
        else:
            print(f"no {bench} record under {args.records}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
