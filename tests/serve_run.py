"""``serve run serve_config.yaml`` -- the design card's command -- as a test server: Serve's
CLI in its own process, its own local Ray, the shipped file with only its port changed."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def serve_run_shipped_config(workdir: Path, port: int) -> Iterator[str]:
    """Runs ``serve run`` on ``serve_config.yaml`` listening on ``port``; yields its base URL
    once ``/health`` answers, and stops it (its Ray included) afterwards."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port  # the shipped file's 8000 may be taken here
    path = workdir / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_cli = Path(sys.executable).parent / "serve"
    log = workdir / "serve_run.log"  # a file, not a pipe: Ray's forwarded logs would fill a pipe and block it
    # --address local: a Ray of its own, never one another test (or a developer) left running
    with open(log, "w") as out:
        process = subprocess.Popen([str(serve_cli), "run", "--address", "local", str(path)], cwd=ROOT, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, f"serve run exited early:\n{log.read_text()[-4000:]}"
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve run did not become healthy in 240 s"
            time.sleep(0.5)
        yield base
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)  # as Ctrl-C: Serve and its Ray shut down
            try:
                # Usually seconds; when Serve's graceful shutdown stalls (seen in CI), the kill
                # below ends it: the tests are about serving, and a long wait costs CI minutes.
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)  # whatever of its Ray is left in its process group
        except ProcessLookupError:
            pass
        process.wait(timeout=30)


try:  # resolved here, in the parent: the child between fork and exec must not import
    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except OSError:
    _PRCTL = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: SIGTERM it if the test process dies first (a CI timeout), so no
    ``serve run`` and its Ray outlive the test run. Linux only; elsewhere a no-op."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
