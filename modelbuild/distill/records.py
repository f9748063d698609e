"""The compact part of the training data, committed so that work accumulates from one
run to the next: the target's answers (``responses.jsonl``) and the offline text chunks
(``texts.jsonl``) as token ids, gzip-compressed, in ``modelbuild/distill/data/``. The
features extracted from them (~6 KB a position) are never committed; ``extract`` makes
them again from these records.

    .venv/bin/python -m specserve.modelbuild.distill.records {pack,unpack} [--data .cache/distill]

``unpack`` seeds a data directory that lacks a file from its committed archive, so
``generate`` then finds every committed answer on disk and generates only new ones;
``pack`` writes the archives from a data directory.
"""
from __future__ import annotations

import argparse
import gzip
from pathlib import Path

from .generate import DEFAULT_OUT

COMMITTED = Path(__file__).resolve().parent / "data"
FILES = ("responses.jsonl", "texts.jsonl")


def unpack(data: Path, committed: Path = COMMITTED) -> list[str]:
    """Seed ``data`` with each committed file it lacks; returns the files seeded."""
    data.mkdir(parents=True, exist_ok=True)
    seeded = []
    for name in FILES:
        archive = committed / f"{name}.gz"
        if archive.is_file() and not (data / name).is_file():
            (data / name).write_bytes(gzip.decompress(archive.read_bytes()))
            seeded.append(name)
    return seeded


def pack(data: Path, committed: Path = COMMITTED) -> list[str]:
    """Write each of ``data``'s record files as its committed archive (deterministic bytes:
    no name or time in the gzip header)."""
    committed.mkdir(parents=True, exist_ok=True)
    packed = []
    for name in FILES:
        if (data / name).is_file():
            lines = sorted(line for line in (data / name).read_text().splitlines() if line.strip())
            body = ("\n".join(lines) + "\n").encode()
            (committed / f"{name}.gz").write_bytes(gzip.compress(body, compresslevel=9, mtime=0))
            packed.append(name)
    return packed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("pack", "unpack"))
    parser.add_argument("--data", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    done = (pack if args.action == "pack" else unpack)(args.data)
    print(f"{args.action}: {', '.join(done) or 'nothing to do'}")


if __name__ == "__main__":
    main()
