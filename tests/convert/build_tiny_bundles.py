"""Write tiny random checkpoints in every published layout and convert them into two
bundles, the way a user would (``python -m specserve.modelbuild.convert``):

- ``OUT/full``: the tiny Llama target + EAGLE-3 (SafeAILab layout) + Qwen3.5 MTP + Gemma-4
  assistant;
- ``OUT/speculators``: the same target + EAGLE-3 (speculators layout, explicit aux layer
  ids, ``norm_before_residual``) + a Qwen3-Next mixture-of-experts MTP head.

``python -m tests.convert.build_tiny_bundles OUT`` (in the convert venv). The server
tests, which run in specserve's own venv, call this through the convert venv.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from specserve.modelbuild.convert.__main__ import main as convert_main

from .tiny_eagle3 import write_tiny_eagle3
from .tiny_gemma4_assistant import write_tiny_gemma4_assistant
from .tiny_llama import TINY, write_tiny_llama
from .tiny_qwen35_mtp import write_tiny_qwen3_next_mtp, write_tiny_qwen35_mtp

SPECULATORS_AUX = [1, 4, 6]  # explicit ids, entering-layer indexing (vLLM takes them as-is)


@dataclass(frozen=True)
class TinyBundles:
    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def target(self) -> Path:
        return self.checkpoints / "llama"

    def head(self, name: str) -> Path:
        return self.checkpoints / name

    @property
    def full(self) -> Path:
        return self.root / "full"

    @property
    def speculators(self) -> Path:
        return self.root / "speculators"


def build(root: Path) -> TinyBundles:
    os.environ.setdefault("TQDM_DISABLE", "1")
    tiny = TinyBundles(root)
    target = write_tiny_llama(tiny.target)
    config = json.loads((target / "config.json").read_text())
    geometry = dict(hidden_size=TINY["hidden_size"], vocab_size=TINY["vocab_size"])
    write_tiny_eagle3(tiny.head("eagle3_safeailab"), config, "safeailab")
    write_tiny_eagle3(tiny.head("eagle3_speculators"), config, "speculators", aux_layer_ids=SPECULATORS_AUX,
                      norm_before_residual=True)
    write_tiny_qwen35_mtp(tiny.head("qwen35_mtp"), **geometry, num_heads=TINY["num_attention_heads"],
                          num_kv_heads=TINY["num_key_value_heads"], head_dim=TINY["head_dim"])
    write_tiny_qwen3_next_mtp(tiny.head("qwen3_next_mtp"), **geometry, num_heads=TINY["num_attention_heads"],
                              num_kv_heads=TINY["num_key_value_heads"], head_dim=TINY["head_dim"])
    write_tiny_gemma4_assistant(tiny.head("gemma4_assistant"), backbone_hidden_size=TINY["hidden_size"],
                                vocab_size=TINY["vocab_size"], kv_heads=TINY["num_key_value_heads"],
                                head_dim=TINY["head_dim"])
    convert_main(["--target", str(target), "--out", str(tiny.full), "--eagle3", str(tiny.head("eagle3_safeailab")),
                  "--mtp", str(tiny.head("qwen35_mtp")), "--assistant", str(tiny.head("gemma4_assistant"))])
    convert_main(["--target", str(target), "--out", str(tiny.speculators),
                  "--eagle3", str(tiny.head("eagle3_speculators")), "--mtp", str(tiny.head("qwen3_next_mtp"))])
    return tiny


if __name__ == "__main__":
    build(Path(sys.argv[1]))
