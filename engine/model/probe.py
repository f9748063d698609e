"""Health probes: run a real model on a minimal input and check its outputs are finite.

Serve's health checks call these (through the workers' ``probe()``), so a stalled or
broken model fails the check and its replica is replaced -- the probe exercises the
same onnxruntime session requests use, not a flag.
"""
from __future__ import annotations

import numpy as np

from specserve.engine.errors import EngineError


class ProbeFailedError(EngineError):
    """A model produced non-finite outputs on its health probe."""


def probe_dim(dim, input_name: str, axis: int) -> int:
    """One step with no past: a past length is 0, every other symbolic dim 1 (a sum such
    as ``past_seq_len + seq_len`` is 1). Exporters name dims differently; an unnamed dim
    of a past input is its sequence axis only at axis 2 ([B, heads, P, dim])."""
    if isinstance(dim, int):
        return dim
    if isinstance(dim, str) and dim:
        return 1 if "+" in dim or "past" not in dim else 0
    return 0 if "past" in input_name and axis == 2 else 1


def probe_session(session, what: str) -> None:
    """Feed zeros of each input's shape (see ``probe_dim``), run, check."""
    feed = {}
    for spec in session.get_inputs():
        shape = [probe_dim(d, spec.name, axis) for axis, d in enumerate(spec.shape)]
        dtype = np.int64 if "int64" in spec.type else (np.float16 if "float16" in spec.type else np.float32)
        feed[spec.name] = np.zeros(shape, dtype)
    if "attention_mask" in feed:
        feed["attention_mask"] = np.ones_like(feed["attention_mask"])
    check_finite(session.run(None, feed), what)


def check_finite(outputs, what: str) -> None:
    if not all(np.isfinite(o).all() for o in outputs if np.asarray(o).dtype.kind == "f"):
        raise ProbeFailedError(f"{what} produced non-finite outputs on its health probe")
