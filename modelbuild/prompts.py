"""Held-out evaluation prompts for tests and benchmarks: ``python -m specserve.modelbuild.prompts``.

Each prompt is a snippet of a held-out corpus file (never trained on) that ends right
after a ``def`` line, so the natural continuation is a function body.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from .corpus import load_corpus

OUT = Path("tests/data/heldout_prompts.json")
_DEF_LINE = re.compile(r"^[ ]{0,4}def [A-Za-z_]\w*\(.*\):[ ]*$", re.MULTILINE)


def heldout_prompts(count: int = 24, context_chars: int = 240) -> list[dict]:
    prompts = []
    for item in load_corpus().heldout:
        matches = [m for m in _DEF_LINE.finditer(item.text) if m.start() >= context_chars]
        if not matches:
            continue
        match = matches[len(matches) // 2]
        start = item.text.rfind("\n", 0, match.start() - context_chars) + 1
        # End right after the ":" -- the newline and the indentation that follows are
        # one BPE token in training text, so a prompt ending in a bare "\n" would be off-distribution.
        prompts.append({"file": item.relpath, "prompt": item.text[start : match.end()]})
        if len(prompts) == count:
            break
    return prompts


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(heldout_prompts(), indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
