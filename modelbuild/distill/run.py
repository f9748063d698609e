"""What every trainer of ``modelbuild.distill`` shares: a module trained for a time budget
(``schedule.py``), resumable from its checkpoint -- AdamW, the clipped update, the trained
seconds counted per update, the checkpoint written every ``save_every`` updates."""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .schedule import set_learning_rate


class TrainingRun:
    def __init__(self, module: torch.nn.Module, key: str, checkpoint: Path, lr: float, minutes: float,
                 updates: int, seed: int, save_every: int, strict: bool = True) -> None:
        self.module, self.key, self.checkpoint = module, key, checkpoint
        self.lr, self.budget, self.updates, self.save_every = lr, minutes * 60, updates, save_every
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.state: dict = {"update": 0, "seconds": 0.0, "log": []}
        if checkpoint.is_file():
            saved = torch.load(checkpoint, weights_only=False)
            module.load_state_dict(saved[key], strict=strict)
            self.optimizer.load_state_dict(saved["optimizer"])
            self.state = saved["state"]
            print(f"resumed at update {self.state['update']} ({self.state['seconds'] / 60:.1f} min trained)",
                  flush=True)
        self.rng = np.random.default_rng(seed + self.state["update"])

    def running(self) -> bool:
        """Budget left: ``minutes`` of training in all, across resumes (the schedule spans it)."""
        return self.state["update"] < self.updates and self.state["seconds"] < self.budget

    def update(self, compute: Callable[[], tuple[torch.Tensor, Any]]) -> tuple[torch.Tensor, Any]:
        """One update on ``compute()``'s (loss, anything) -- its batch drawn inside, so its
        time counts -- then the checkpoint when one is due."""
        started = time.perf_counter()
        set_learning_rate(self.optimizer, self.lr, self.state["seconds"], self.budget)
        loss, extra = compute()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
        self.optimizer.step()
        self.state["update"] += 1
        self.state["seconds"] += time.perf_counter() - started
        if self.state["update"] % self.save_every == 0:
            self.save()
        return loss, extra

    def save(self) -> None:
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.checkpoint.with_suffix(".tmp")
        torch.save({self.key: self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "state": self.state}, scratch)
        scratch.replace(self.checkpoint)
