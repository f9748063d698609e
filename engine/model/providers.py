"""Execution-provider choice for onnxruntime sessions.

``onnxruntime-gpu`` on a machine without CUDA logs an error and silently runs on CPU, so
"auto" never trusts the provider list we asked for: it creates the session, then reads
``session.get_providers()`` to learn what really loaded. The choice is logged once per
process and device string.
"""
from __future__ import annotations

import logging

import onnxruntime as ort

from engine.config import Device, SpinPolicy
from engine.errors import ModelLoadError

log = logging.getLogger("specserve.engine")
_logged: set[str] = set()
_cuda_unusable = False  # remembered so "auto" tries (and logs the CUDA failure) only once


def session_options(intra_op_threads: int | None, inter_op_threads: int | None = None,
                    spinning: SpinPolicy = "always") -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if intra_op_threads is not None:
        options.intra_op_num_threads = intra_op_threads
    if inter_op_threads is not None:
        options.inter_op_num_threads = inter_op_threads
    options.log_severity_level = 3  # errors only; provider fallbacks are checked explicitly
    if spinning == "never":
        # Idle pool threads that spin-wait after a run steal the cores the next session
        # needs; a session that alternates with others (a proposer) should sleep instead.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    elif spinning == "within_run":
        # Threads that sleep between ops wake for every one of them; spinning only until
        # the run ends leaves the cores to the other processes between runs.
        options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


def create_session(path: str, device: Device, options: ort.SessionOptions) -> ort.InferenceSession:
    """Create a session on the requested device and verify the providers that loaded."""
    global _cuda_unusable
    want_cuda = device == "cuda" or (
        device == "auto" and not _cuda_unusable and "CUDAExecutionProvider" in ort.get_available_providers())
    if want_cuda:
        session = ort.InferenceSession(path, options, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        if "CUDAExecutionProvider" in session.get_providers():
            _log_choice(device, "CUDAExecutionProvider")
            return session
        if device == "cuda":
            raise ModelLoadError(f"device='cuda' requested but CUDAExecutionProvider did not load for {path} "
                                 f"(loaded: {session.get_providers()}); use device='auto' or 'cpu'")
        _cuda_unusable = True
        _log_choice(device, "CPUExecutionProvider (CUDA is not usable on this machine)")
        return session
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    reason = " (CUDA is not usable on this machine)" if device == "auto" and _cuda_unusable else ""
    _log_choice(device, "CPUExecutionProvider" + reason)
    return session


def _log_choice(device: str, chosen: str) -> None:
    key = f"{device}->{chosen}"
    if key not in _logged:
        _logged.add(key)
        log.info("onnxruntime %s: device=%s -> %s", ort.__version__, device, chosen)
