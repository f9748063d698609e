"""Execution-provider choice for onnxruntime sessions.

``onnxruntime-gpu`` asked for its CUDA provider on a machine without CUDA's libraries
prints an ERROR and a warning of its own and runs on CPU. So the libraries are probed
first, without onnxruntime (``cuda_unavailable``: the provider library loaded by the
dynamic linker, which names the first CUDA library it misses, then the driver and a
device): ``auto`` asks for CUDA only where they are there, and a CPU start prints
nothing but one INFO line saying which provider serves and why. Where CUDA is asked for
(``device="cuda"``) the session is created with it and checked to have loaded it
(``session.get_providers()``), else a clear error. The choice is logged once per process
and device string.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import onnxruntime as ort

from specserve.engine.config import Device, SpinPolicy
from specserve.engine.errors import ModelLoadError

log = logging.getLogger("specserve.engine")
_logged: set[str] = set()
CUDA_PROVIDER_LIBRARY = "libonnxruntime_providers_cuda.so"  # beside onnxruntime's own, in onnxruntime/capi


@functools.cache
def cuda_unavailable() -> str | None:
    """Why CUDA cannot serve here, or None where it can: found without asking onnxruntime
    for the provider, which would print an ERROR for each library it misses."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "this onnxruntime build has no CUDA provider"
    library = Path(ort.__file__).parent / "capi" / CUDA_PROVIDER_LIBRARY
    if library.is_file():
        try:
            ctypes.CDLL(str(library))  # loads cuBLAS, the CUDA runtime and the driver it links, or names the missing one
        except OSError as error:
            if "cannot open shared object file" in str(error):
                return f"CUDA's libraries are not installed ({error})"
            # Anything else (a symbol the linker resolves only inside onnxruntime): let
            # onnxruntime itself try, as it would without this probe.
            return None
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no CUDA driver (libcuda.so.1)"
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return "no CUDA device"
    return None
_cuda_refused = False  # onnxruntime refused CUDA once though its libraries load: "auto" stops asking


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
    """A session on the requested device, its providers checked. ``auto`` asks for CUDA only
    where ``cuda_unavailable`` finds it usable; ``cuda`` where it is not is a clear error."""
    global _cuda_refused
    unusable = cuda_unavailable() or ("onnxruntime did not start it" if _cuda_refused else None)
    if device == "cuda" and unusable:
        raise ModelLoadError(f"device='cuda' requested but CUDAExecutionProvider did not load for {path}: "
                             f"{unusable}; use device='auto' or 'cpu'")
    if device == "cuda" or (device == "auto" and unusable is None):
        session = ort.InferenceSession(path, options, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        if "CUDAExecutionProvider" in session.get_providers():
            _log_choice(device, "CUDAExecutionProvider")
            return session
        if device == "cuda":
            raise ModelLoadError(f"device='cuda' requested but CUDAExecutionProvider did not load for {path} "
                                 f"(loaded: {session.get_providers()}); use device='auto' or 'cpu'")
        _cuda_refused = True  # its libraries load, but onnxruntime could not start it: do not ask again
        _log_choice(device, "CPUExecutionProvider (CUDA's libraries load, but onnxruntime did not start it)")
        return session
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    _log_choice(device, "CPUExecutionProvider" + (f" ({unusable})" if device == "auto" else ""))
    return session


def _log_choice(device: str, chosen: str) -> None:
    key = f"{device}->{chosen}"
    if key not in _logged:
        _logged.add(key)
        log.info("onnxruntime %s: device=%s -> %s", ort.__version__, device, chosen)
