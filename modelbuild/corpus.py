"""The training corpus: the CPython standard library sources shipped with the interpreter.

Every machine of this kind has them, so the models can be rebuilt offline. Whole files
are held out (every ``HOLDOUT_EVERY``-th in sorted order) so evaluation never sees text
from a file the model trained on.
"""
from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HOLDOUT_EVERY = 8
# Test suites, IDLE, bundled third-party code and generated tables are not "the stdlib's
# own prose"; they also repeat themselves a lot, which would inflate any loss figure.
EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__", "ensurepip", "turtledemo", "unittest"}
MAX_FILE_BYTES = 400_000


@dataclass(frozen=True)
class CorpusFile:
    relpath: str
    sha256: str
    text: str


@dataclass(frozen=True)
class Corpus:
    root: Path
    python_version: str
    train: list[CorpusFile]
    heldout: list[CorpusFile]

    def describe(self) -> dict:
        """What the manifest records: enough to check a rebuild saw the same text."""
        return {
            "source": "CPython standard library sources shipped with the interpreter",
            "python_version": self.python_version,
            "root": str(self.root),
            "selection": "all *.py under the stdlib root, sorted, excluding directories "
            + ", ".join(sorted(EXCLUDED_DIRS)) + f" and files over {MAX_FILE_BYTES} bytes",
            "heldout_rule": f"every {HOLDOUT_EVERY}th file in sorted order (index % {HOLDOUT_EVERY} == {HOLDOUT_EVERY - 1})",
            "train_files": {f.relpath: f.sha256 for f in self.train},
            "heldout_files": {f.relpath: f.sha256 for f in self.heldout},
        }


def load_corpus(root: Path | None = None) -> Corpus:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in root.rglob("*.py")
        if not (set(p.relative_to(root).parts[:-1]) & EXCLUDED_DIRS) and p.stat().st_size <= MAX_FILE_BYTES
    )
    train: list[CorpusFile] = []
    heldout: list[CorpusFile] = []
    for index, path in enumerate(paths):
        raw = path.read_bytes()
        item = CorpusFile(str(path.relative_to(root)), hashlib.sha256(raw).hexdigest(), raw.decode("utf-8", "replace"))
        (heldout if index % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else train).append(item)
    if not train or not heldout:
        raise RuntimeError(f"no corpus files found under {root}")
    return Corpus(root, sys.version.split()[0], train, heldout)
