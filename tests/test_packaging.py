"""The installed layout: one top-level name, ``specserve``, and a default model found from the
package or a configured data home, never from wherever the source tree happens to be."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from .conftest import ROOT

FOLDERS = ("engine", "deployments", "cluster", "modelbuild")
BARE_NAMES = {*FOLDERS, "models"}


def test_no_source_imports_a_folder_by_its_bare_name():
    offenders = []
    for folder in (*FOLDERS, "specserve", "bench", "tests", "models"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                         else [])
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                              if name.split(".")[0] in BARE_NAMES]
    assert not offenders, offenders


def test_the_wheel_installs_one_top_level_package(tmp_path):
    # Built from the tracked files alone: a checkout's build/ or converted models never leak in.
    source = tmp_path / "source"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--disable-pip-version-check",
                    str(source), "-w", str(tmp_path)], check=True, timeout=300, capture_output=True)
    (wheel,) = tmp_path.glob("specserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"specserve", wheel.name.split("-py3")[0] + ".dist-info"}
    packages = {"/".join(name.split("/")[:-1]) for name in names if name.endswith("/__init__.py")}
    for folder in FOLDERS:  # every subpackage of every folder travels, under specserve/
        expected = {f"specserve/{p.parent.relative_to(ROOT)}" for p in (ROOT / folder).rglob("__init__.py")}
        assert expected <= packages, expected - packages
    model = "specserve/models/smollm2-135m-instruct/"
    assert model + "manifest.json" in names and model + "heads/eagle3/model.onnx" in names
    assert model + "draft/model.safetensors" in names
    from specserve.modelbuild.default_model import PACKAGED_PARTS  # what a conversion seeds from: all shipped
    seeded = [name for name in tracked.decode().split("\0") if name.startswith("models/smollm2-135m-instruct/")
              and any(name.removeprefix("models/smollm2-135m-instruct/").startswith(part) for part in PACKAGED_PARTS)]
    assert seeded and {f"specserve/{name}" for name in seeded} <= set(names)
    assert not [n for n in names if n.startswith(model + "target/") or "/fixture/" in n]  # converted, not shipped
    assert "specserve/cluster/grafana-dashboard.json" in names


def _resolution(env: dict[str, str], code: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("SPECSERVE_MODEL", "SPECSERVE_HOME")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/",
                          env={**clean, **env})


def test_a_data_home_without_the_model_names_the_command_that_converts_it(tmp_path):
    run = _resolution({"SPECSERVE_HOME": str(tmp_path)}, "from specserve.engine.model.default_model import "
                      "default_model_dir; default_model_dir()")
    assert run.returncode != 0
    assert "specserve convert --default-model" in run.stderr and str(tmp_path / "models") in run.stderr


def test_the_checkout_is_the_data_home_when_none_is_configured():
    run = _resolution({}, "from specserve.engine.model.default_model import default_model_dir; print(default_model_dir())")
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()) == ROOT / "models" / "smollm2-135m-instruct"


def test_a_bundle_outside_the_checkout_is_seeded_with_the_packaged_heads(tmp_path):
    from specserve.engine.model.default_model import PACKAGED_DEFAULT_MODEL
    from specserve.modelbuild.default_model import seed_from_package

    out = tmp_path / "models" / "smollm2-135m-instruct"
    seed_from_package(out)
    for name in ("manifest.json", "heads/eagle3/model.onnx", "heads/mtp/d2t.npy", "draft/model.safetensors"):
        assert (out / name).read_bytes() == (PACKAGED_DEFAULT_MODEL / name).read_bytes()
    assert not (out / "target").exists() and not (out / "draft/model.onnx").exists()  # converted, not copied
    (out / "heads/mtp/d2t.npy").write_bytes(b"kept")
    seed_from_package(out)  # a bundle with a manifest is the user's: never overwritten
    assert (out / "heads/mtp/d2t.npy").read_bytes() == b"kept"
