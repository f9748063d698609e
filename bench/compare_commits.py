"""This checkout's ``bench/speculative.py`` against another commit's, in one run.

    .venv/bin/python bench/compare_commits.py --ref e3e3d86 [--repeats 3] [--prompts 10] [--new-tokens 64]

Checks ``--ref`` out into a temporary git worktree, then runs both benches alternately
(ref, this, ref, this, ...), each in its own process on the same bundled models, and
prints each mode's median tokens/s for both and their ratio. Alternating spreads this
machine's run-to-run drift over both sides. Both benches time decoding after a warm-up
request, so the figures exclude onnxruntime's first-call cost.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^(\w+)\s+([\d.]+)\s+[\d.]+x\s+[\d.]+\s+[\d.]+\s+(\w+)\s*$")


def run_bench(checkout: Path, args: argparse.Namespace) -> dict[str, tuple[float, str]]:
    """mode -> (tokens/s, identical?) parsed from the bench's table."""
    out = subprocess.run([sys.executable, str(checkout / "bench/speculative.py"), "--prompts", str(args.prompts),
                          "--new-tokens", str(args.new_tokens), "--models", str(ROOT / "models/fixture"), "--device", "cpu"],
                         cwd=checkout, capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = (float(match.group(2)), match.group(3))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", required=True, help="the commit to compare against, e.g. the one before a change")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ref_dir = Path(tmp) / "ref"
        subprocess.run(["git", "worktree", "add", "--detach", str(ref_dir), args.ref], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            runs: dict[str, list[dict]] = {"ref": [], "this": []}
            for i in range(args.repeats):
                for side, checkout in (("ref", ref_dir), ("this", ROOT)):
                    runs[side].append(run_bench(checkout, args))
                    print(f"run {i + 1}/{args.repeats} {side} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(ref_dir)], cwd=ROOT, check=False)
    print(f"{args.prompts} held-out prompts x {args.new_tokens} tokens, greedy, batch 1; median of {args.repeats} "
          f"alternating runs; tokens/s after warm-up")
    print(f"{'mode':14s} {args.ref[:10]:>10s} {'this':>10s} {'ratio':>7s}  identical to target-only (ref/this)")
    for mode in runs["this"][0]:
        ref = statistics.median(r[mode][0] for r in runs["ref"] if mode in r)
        this = statistics.median(r[mode][0] for r in runs["this"])
        same = "/".join(sorted({r[mode][1] for r in runs["ref"] if mode in r} | set())) + " / " + \
            "/".join(sorted({r[mode][1] for r in runs["this"]}))
        print(f"{mode:14s} {ref:10.1f} {this:10.1f} {this / ref:6.2f}x  {same}")


if __name__ == "__main__":
    main()
