"""The learning rate as a function of training time, not of an update count.

A head's run is given minutes (each step of the pipeline must fit its time on 2 cores),
and how many updates fit them depends on the machine and on what else it runs. So the
schedule is laid over the time budget: a linear warm-up over its first 5 %, then a cosine
down to 5 % of the peak at its end. A resumed run goes on from the seconds its checkpoint
has trained, and a larger ``--minutes`` on a rerun extends the same curve's tail.
"""
from __future__ import annotations

import math

import torch

WARMUP = 0.05
FLOOR = 0.05


def learning_rate(peak: float, seconds: float, budget: float) -> float:
    progress = min(1.0, seconds / budget) if budget > 0 else 1.0
    if progress < WARMUP:
        return peak * max(progress / WARMUP, 0.01)
    cosine = 0.5 * (1 + math.cos(math.pi * (progress - WARMUP) / (1 - WARMUP)))
    return peak * (FLOOR + (1 - FLOOR) * cosine)


def set_learning_rate(optimizer: torch.optim.Optimizer, peak: float, seconds: float, budget: float) -> float:
    rate = learning_rate(peak, seconds, budget)
    for group in optimizer.param_groups:
        group["lr"] = rate
    return rate
