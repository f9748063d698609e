"""The conversion tests run in the convert venv (torch, transformers, mobius-onnx):
``bash scripts/test_convert.sh``. specserve's own venv skips this directory (see
``tests/conftest.py``) and tests the converted bundles through the server instead."""
from __future__ import annotations

import pytest

from .build_tiny_bundles import TinyBundles, build


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyBundles:
    return build(tmp_path_factory.mktemp("tiny"))
