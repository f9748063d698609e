"""The ``specserve`` command as a user meets it: installed as a console script, and its
interactive chat driven in a real terminal (tmux)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

SPECSERVE = Path(sys.executable).with_name("specserve")


def test_the_command_lists_its_subcommands_and_refuses_an_unknown_one():
    listed = subprocess.run([SPECSERVE, "--help"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0
    for command in ("serve", "chat", "generate", "convert", "bench"):
        assert f"specserve {command}" in listed.stdout
    unknown = subprocess.run([SPECSERVE, "frobnicate"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2
    benches = subprocess.run([SPECSERVE, "bench", "--list"], capture_output=True, text=True, timeout=60)
    assert "tasks" in benches.stdout and "peers" in benches.stdout


def _pane(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-J", "-S", "-200", "-t", session],
                          capture_output=True, text=True, timeout=30).stdout


def _wait_for(session: str, check, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        text = _pane(session)
        if check(text):
            return text
        time.sleep(0.5)
    raise AssertionError(f"the terminal never showed what was waited for:\n{_pane(session)}")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_chat_in_a_terminal_answers_and_prints_its_speed():
    """The default model, embedded, with the command's own defaults: the chat serves the exact
    format, whose float32 answers this question "The capital of France is Paris." (at its
    first token the fast format's int8 activations, as llama.cpp's on the same GGUF, tip a
    near tie toward "L'Étoile, ...": docs/models.md)."""
    session = f"specserve-chat-{uuid.uuid4().hex[:8]}"
    command = f"{SPECSERVE} chat --max-new-tokens 24 2>/dev/null"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "50", command],
                   check=True, timeout=30)
    try:
        _wait_for(session, lambda text: text.rstrip().endswith(">"), 240)
        subprocess.run(["tmux", "send-keys", "-t", session, "What is the capital of France?", "Enter"],
                       check=True, timeout=30)
        shown = _wait_for(session, lambda text: "tokens/s" in text, 120)
        reply = shown.split("What is the capital of France?", 1)[1]
        assert "Paris" in reply.split("tokens/s")[0]
        subprocess.run(["tmux", "send-keys", "-t", session, "/exit", "Enter"], check=True, timeout=30)
        deadline = time.monotonic() + 30
        while subprocess.run(["tmux", "has-session", "-t", session], capture_output=True, timeout=30).returncode == 0:
            assert time.monotonic() < deadline, "the chat did not leave on /exit"
            time.sleep(0.3)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, timeout=30)
