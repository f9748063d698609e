"""Applying a checkpoint's tensors to a mobius graph, refusing a mismatch either way: a
tensor the graph has no place for (a layout the builder misread) or a graph weight the
checkpoint lacks (which would otherwise stay uninitialised and draft garbage)."""
from __future__ import annotations

from pathlib import Path


def apply_every_weight(package, weights: dict, source: Path) -> None:
    """``package.apply_weights(weights)`` on its one graph, checked both ways."""
    model = package["model"]
    unused = sorted(set(weights) - set(model.graph.initializers))
    if unused:
        raise ValueError(f"{source}: tensors the graph has no place for: {unused[:8]}")
    package.apply_weights(weights)
    missing = sorted(name for name, value in model.graph.initializers.items() if value.const_value is None)
    if missing:
        raise ValueError(f"{source}: graph weights the checkpoint lacks: {missing[:8]}")
