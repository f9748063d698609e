"""Every head of the default model rebuilt from its GGUF, in one command:

    .venv-convert/bin/python -m specserve.modelbuild.distill [--minutes eagle3=78 mtp=20 ...] [--train-answers N]

1. the target converted from the package index's GGUF (``modelbuild.default_model``);
2. the committed answers and text chunks unpacked (``records``), then its own answers to
   the chat prompts that have none yet (``generate``) and the offline text chunks
   (``texts``) where none are committed;
3. its states over them (``extract``), the training answers cut to ``--train-answers``;
4. the heads trained and exported into the bundle, in two lanes of one thread each (a
   core each on 2 cores): EAGLE-3 in one, then MTP, the shared-KV assistant and the
   draft model in the other (``train``, ``draft_model``).

Every step resumes where an interrupted run stopped (answers on disk, extracted splits,
checkpoints), so rerunning the command after a stop loses at most a checkpoint interval;
``python -m specserve.modelbuild.distill.records pack`` commits what was generated.
The seeds are the steps' defaults, recorded with each head in the manifest.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from . import extract, generate, records, texts

MINUTES = {"eagle3": 78.0, "mtp": 20.0, "shared_kv": 20.0, "draft_model": 20.0}
LANES = (("eagle3",), ("mtp", "shared_kv", "draft_model"))


def training_command(kind: str, minutes: float, bundle: str) -> list[str]:
    step = ["specserve.modelbuild.distill.draft_model"] if kind == "draft_model" else ["specserve.modelbuild.distill.train", kind]
    return [sys.executable, "-m", *step, "--threads", "1", "--minutes", str(minutes), "--bundle", bundle,
            "--export", bundle]


def run_lane(commands: list[list[str]]) -> None:
    for command in commands:
        subprocess.run(command, check=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", nargs="*", default=[], metavar="KIND=MINUTES",
                        help=f"training time per head (defaults: {MINUTES})")
    parser.add_argument("--train-answers", type=int, default=None, help="default: every training answer")
    args = parser.parse_args(argv)
    minutes = {**MINUTES, **{k: float(v) for k, v in (item.split("=", 1) for item in args.minutes)}}
    from ..default_model import ensure_default_model

    bundle = ensure_default_model()
    records.unpack(generate.DEFAULT_OUT)
    generate.main(["--bundle", str(bundle)])
    if not (generate.DEFAULT_OUT / "texts.jsonl").is_file():
        texts.main(["--bundle", str(bundle)])
    cut = [] if args.train_answers is None else ["--train-answers", str(args.train_answers)]
    extract.main(["--bundle", str(bundle), *cut])
    lanes = [[training_command(kind, minutes[kind], str(bundle)) for kind in lane] for lane in LANES]
    with ThreadPoolExecutor(len(lanes)) as pool:
        for done in [pool.submit(run_lane, lane) for lane in lanes]:
            done.result()


if __name__ == "__main__":
    main()
