"""Standing rules of the layout: the engine is Ray-free and the CLI works as documented."""
from __future__ import annotations

import re
import subprocess
import sys

from .conftest import ROOT


def test_engine_never_imports_ray():
    offenders = [p.name for p in (ROOT / "engine").rglob("*.py")
                 if re.search(r"^\s*(import ray|from ray)", p.read_text(), re.MULTILINE)]
    assert not offenders
    probe = "import sys, specserve.engine, specserve.engine.__main__; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                          check=True).stdout.strip() == "False"


def test_cli_generates_and_reports_speed_and_finish_reason():
    run = subprocess.run([sys.executable, "-m", "specserve.engine", "generate", "--model", "models/fixture/target", "--device", "cpu",
                          "--prompt", "import os\n\n\ndef main(", "--max-new-tokens", "12"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("import os\n\n\ndef main(")
    assert re.search(r"\[12 tokens, [\d.]+ tokens/s incl. prefill \(sessions warmed up at load\), finish_reason=length\]",
                     run.stdout)


def test_cli_rejects_bad_options_with_the_field_named():
    run = subprocess.run([sys.executable, "-m", "specserve.engine", "generate", "--model", "models/fixture/target",
                          "--prompt", "x", "--top-p", "1.5"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2 and "top_p" in run.stderr


def test_cli_names_a_missing_model_directory():
    run = subprocess.run([sys.executable, "-m", "specserve.engine", "generate", "--model", "models/nope", "--prompt", "x"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2 and "models/nope" in run.stderr


def test_cli_constrains_the_output_and_names_a_bad_grammar():
    run = subprocess.run([sys.executable, "-m", "specserve.engine", "generate", "--model", "models/fixture/target", "--device", "cpu",
                          "--prompt", "x = ", "--choice", "True", "--choice", "None", "--no-stream"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[0] in ("x = True", "x = None") and "finish_reason=stop" in run.stdout
    run = subprocess.run([sys.executable, "-m", "specserve.engine", "generate", "--model", "models/fixture/target",
                          "--prompt", "x", "--regex", "a(b"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2 and "unclosed group" in run.stderr
