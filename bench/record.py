"""A bench's record: its full printed result as a dated markdown file.

Every bench takes ``--record DIR``. When the bench finishes, what it printed to stdout
(its table and summary lines; progress goes to stderr and is not kept) is written to
``DIR/<bench>-YYYY-MM-DD.md`` with the command line, the commit and the machine it ran
on, after deleting that bench's older records in DIR: a directory of records holds each
bench's latest full result, and git keeps the ones before it.

    parser = argparse.ArgumentParser(...)
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "speculative", model=args.models):
        ...  # everything the bench prints
"""
from __future__ import annotations

import argparse
import datetime as dt
import io
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--record", type=Path, default=None, metavar="DIR", help=(
        "also write this run's printed result to DIR/<bench>-YYYY-MM-DD.md (command, commit, machine), "
        "replacing this bench's older records there, e.g. --record docs/benchmarks"))


class _Tee:
    """stdout as before, with every write also kept for the record; anything else a
    caller asks of stdout (fileno, encoding, isatty) is the terminal's."""

    def __init__(self, terminal, buffer: io.StringIO) -> None:
        self.terminal, self.buffer = terminal, buffer

    def write(self, text: str) -> int:
        self.buffer.write(text)
        return self.terminal.write(text)

    def flush(self) -> None:
        self.terminal.flush()

    def __getattr__(self, name: str):
        return getattr(self.terminal, name)


@contextmanager
def recording(directory: Path | None, bench: str, model: str | Path | None = None) -> Iterator[None]:
    """Capture what the block prints; on a normal exit write it as ``bench``'s record in
    ``directory`` (None: record nothing). The directory is made first, so a path that
    cannot be written fails before a long run, not after it. A block that raises writes
    nothing and leaves older records in place."""
    if directory is None:
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.timezone.utc)
    facts = machine_facts(model)  # before the run: the commit and the tree it measures
    buffer, terminal = io.StringIO(), sys.stdout
    sys.stdout = _Tee(terminal, buffer)
    try:
        yield
    finally:
        sys.stdout = terminal
    path = write(directory, bench, buffer.getvalue(), facts, started)
    print(f"record written: {path}", file=sys.stderr)
    _draw(path)


def _draw(record: Path) -> None:
    """The record's picture beside it, where its bench has one (``bench/plots.py``)."""
    try:
        from bench import plots
    except ImportError:
        return
    try:
        picture = plots.draw(record)
    except ImportError:
        print("no picture drawn: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return
    except Exception as exc:  # noqa: BLE001 - a run that printed less (fewer modes) still keeps its record
        print(f"no picture drawn: {exc!r}", file=sys.stderr)
        return
    if picture is not None:
        print(f"picture written: {picture}", file=sys.stderr)


# A line Ray's log monitor forwards to the driver's stdout from its own processes
# ("(raylet) ...", "(ServeReplica:app:Router pid=123) ..."), coloured or not: Ray's, not the bench's.
RAY_LOG_LINE = re.compile(r"^(\x1b\[[0-9;]*m)?\((raylet|[\w:.-]+ pid=\d+)\)")


def write(directory: Path, bench: str, output: str, facts: dict[str, str], started: dt.datetime) -> Path:
    """Delete ``bench``'s older records (and pictures) in ``directory``, then write this one (less the
    lines Ray forwarded)."""
    output = "\n".join(line for line in output.splitlines() if not RAY_LOG_LINE.match(line))
    pattern = re.compile(rf"{re.escape(bench)}-\d{{4}}-\d{{2}}-\d{{2}}\.(md|png)")  # the record and its picture
    for old in directory.iterdir():
        if pattern.fullmatch(old.name):
            old.unlink()
    path = directory / f"{bench}-{started:%Y-%m-%d}.md"
    lines = [f"# `{bench}` bench: latest full result", "",
             f"Written by `bench/{bench}.py --record` at {started:%Y-%m-%d %H:%M} UTC; "
             "the bench's next recorded run replaces this file.", "",
             "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in facts.items()]
    lines += ["", "## Output", "", "```text", output.rstrip("\n"), "```", ""]
    path.write_text("\n".join(lines))
    return path


def machine_facts(model: str | Path | None = None) -> dict[str, str]:
    facts = {"command": f"`{command_line()}`", "commit": commit()}
    if model is not None:
        facts["model"] = f"`{_relative(Path(model))}`"
    facts["CPU"] = cpu_model()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    facts["cores"] = f"{os.cpu_count()} logical, {usable} usable by this process"
    memory = _meminfo_gib()
    if memory:
        facts["memory"] = memory
    gpu = _gpus()
    if gpu:
        facts["GPU"] = gpu
    facts["OS"] = platform.platform()
    facts["Python"] = platform.python_version()
    facts["packages"] = ", ".join(f"{name} {version}" for name, version in _versions().items())
    return facts


def command_line() -> str:
    script = Path(sys.argv[0])
    return shlex.join(["python", str(_relative(script)), *sys.argv[1:]])


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short=10", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"`{head}`" + (" with uncommitted changes" if dirty else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _meminfo_gib() -> str | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gpus() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=10, check=True).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return None
    names = [n.strip() for n in names if n.strip()]
    return ", ".join(names) or None


def _versions() -> dict[str, str]:
    found = {}
    for name in ("onnxruntime-gpu", "onnxruntime", "numpy", "ray", "tokenizers"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def _relative(path: Path) -> Path:
    try:
        return path.resolve().relative_to(ROOT)
    except ValueError:
        return path
