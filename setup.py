"""The installed layout: the design's top-level folders become subpackages of ``specserve``
(``engine/`` installs as ``specserve.engine``, and so on), so an install adds one top-level
name. The project's metadata is in ``pyproject.toml``."""
from setuptools import find_packages, setup

FOLDERS = ("engine", "deployments", "cluster", "modelbuild")  # each installs as specserve.<folder>
DEFAULT_MODEL = "smollm2-135m-instruct"
# The default model's committed parts (its heads, draft model weights and manifest) travel in
# the wheel; its target is converted from the GGUF by `specserve convert --default-model`.
MODEL_FILES = [f"{DEFAULT_MODEL}/manifest.json", f"{DEFAULT_MODEL}/heads/*/config.json",
               f"{DEFAULT_MODEL}/heads/*/d2t.npy", f"{DEFAULT_MODEL}/heads/*/*.onnx",
               f"{DEFAULT_MODEL}/heads/*/model.safetensors", f"{DEFAULT_MODEL}/draft/config.json",
               f"{DEFAULT_MODEL}/draft/d2t.npy", f"{DEFAULT_MODEL}/draft/model.safetensors"]


def subpackages(folder: str) -> list[str]:
    return [f"specserve.{folder}", *(f"specserve.{folder}.{name}" for name in find_packages(folder))]


setup(
    packages=["specserve", "specserve.models", *(name for folder in FOLDERS for name in subpackages(folder))],
    package_dir={"specserve": "specserve", "specserve.models": "models",
                 **{f"specserve.{folder}": folder for folder in FOLDERS}},
    package_data={"specserve.models": MODEL_FILES, "specserve.cluster": ["*.yaml", "*.json", "README.md"],
                  "specserve.modelbuild": ["convert-requirements.txt"]},
)
