"""Pictures of the latest bench records, as SVG beside them (no plotting library):

    .venv/bin/python bench/plots.py [--records docs/benchmarks]

- ``speed-vs-streams.svg``: tokens/s against concurrent streams per mode, adaptive and at
  a fixed k, from the latest ``adaptive`` record;
- ``acceptance-per-position.svg``: each proposer's acceptance at every draft position, at
  its longest draft length, from the latest ``heads`` record.

Each picture is redrawn from the record's text table, so it always shows the numbers the
record holds; run it after a bench re-records.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
COLOURS = ("#444444", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2")
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 720, 420, 70, 190, 40, 50

Series = tuple[str, list[tuple[float, float]], bool]  # name, points, dashed


def latest(records: Path, bench: str) -> Path:
    found = sorted(records.glob(f"{bench}-*.md"))
    if not found:
        raise SystemExit(f"no {bench} record under {records}")
    return found[-1]


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
        values = [float(v) for v in re.findall(r"(?<![(\d.])(\d+\.\d+)(?!x)", line)]
        rows.append((float(cells[0]), values))
    return [(name, [(streams, values[i]) for streams, values in rows if i < len(values)], "k=" in name)
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
    return [(f"{mode} (k={k})", [(i + 1, a) for i, a in enumerate(values)], False)
            for mode, (k, values) in longest.items()]


def svg_chart(series: Sequence[Series], title: str, x_label: str, y_label: str, log_x: bool = False,
              y_max: float | None = None) -> str:
    import math

    xs = [x for _, points, _ in series for x, _ in points]
    ys = [y for _, points, _ in series for _, y in points]
    fx = (lambda v: math.log2(v)) if log_x else (lambda v: v)
    x_lo, x_hi = fx(min(xs)), fx(max(xs))
    x_hi = x_hi if x_hi > x_lo else x_lo + 1
    y_hi = y_max if y_max is not None else max(ys) * 1.1
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (fx(x) - x_lo) / (x_hi - x_lo) * plot_w

    def py(y: float) -> float:
        return TOP + plot_h - y / y_hi * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="15">{title}</text>',
           f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" stroke="black"/>',
           f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" stroke="black"/>',
           f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 12}" text-anchor="middle">{x_label}</text>',
           f'<text transform="translate(18,{TOP + plot_h / 2}) rotate(-90)" text-anchor="middle">{y_label}</text>']
    for x in sorted(set(xs)):
        out.append(f'<text x="{px(x):.1f}" y="{TOP + plot_h + 18}" text-anchor="middle">{x:g}</text>')
    for i in range(6):
        y = y_hi * i / 5
        out.append(f'<line x1="{LEFT}" y1="{py(y):.1f}" x2="{LEFT + plot_w}" y2="{py(y):.1f}" stroke="#e0e0e0"/>')
        out.append(f'<text x="{LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.3g}</text>')
    modes = list(dict.fromkeys(name.split(" ")[0] for name, _, _ in series))  # a mode's lines share a colour
    for index, (name, points, dashed) in enumerate(series):
        colour = COLOURS[modes.index(name.split(" ")[0]) % len(COLOURS)]
        dash = ' stroke-dasharray="5,4"' if dashed else ""
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>' for x, y in points]
        ly = TOP + 14 + index * 17
        out.append(f'<line x1="{WIDTH - RIGHT + 12}" y1="{ly - 4}" x2="{WIDTH - RIGHT + 36}" y2="{ly - 4}" '
                   f'stroke="{colour}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{WIDTH - RIGHT + 42}" y="{ly}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=Path, default=ROOT / "docs/benchmarks")
    args = parser.parse_args(argv)
    adaptive, heads = latest(args.records, "adaptive"), latest(args.records, "heads")
    charts = {"speed-vs-streams.svg": svg_chart(speed_series(adaptive), f"Speed against streams ({adaptive.name}; "
                                                "dashed: k = 4)", "streams", "tokens/s", log_x=True),
              "acceptance-per-position.svg": svg_chart(acceptance_series(heads), f"Acceptance per draft position "
                                                       f"({heads.name})", "draft position", "acceptance", y_max=1.0)}
    for name, svg in charts.items():
        (args.records / name).write_text(svg)
        print(f"wrote {args.records / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
