"""The framework tools of docs/gateways.md's recipes, each installed once into its own venv under the cache
directory (``$OTEL_CAPTURE_CACHE``, else ``~/.cache/otel-capture``), as Phoenix and vLLM are: their pins
clash with each other and with the project's (LiteLLM pins its own openai, verifiers and inspect-ai theirs),
so none goes into the project's venv. A venv is keyed by its requirements and the Python that made it,
built under a file lock (concurrent runs install it once), and marked complete only after pip succeeded.

Also the recipes' shared pieces: a fenced block read from docs/gateways.md as the page shows it, and a
child process run with its output kept for the assertion message.
"""

from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from otel_capture import CaptureStore
from otel_capture._settings import cache_dir

REPO = Path(__file__).resolve().parents[2]
GATEWAYS = REPO / "docs" / "gateways.md"
INSTALL_TIMEOUT = 1200.0

# What each recipe installs, pinned to the releases the recipes were checked with (issue 33).
LITELLM = ["litellm[proxy]==1.106.12"]
VERIFIERS = ["verifiers==0.4.0"]
INSPECT_AI = ["inspect-ai==0.3.285", "openai>=1.60"]  # inspect-ai's OpenAI provider needs the SDK


@dataclass
class CaptureProxy:
    """The capture proxy a recipe runs against: its URL and its capture directory."""

    url: str
    store: CaptureStore


class ToolUnavailable(RuntimeError):
    """A recipe's tool cannot be installed here (the message says why: the test skips with it, or fails
    under CI=true)."""


def tool_venv(name: str, requirements: list[str]) -> Path:
    """The venv of one recipe's tool, created on first use; returns its folder."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256("\n".join([sys.version, *requirements]).encode()).hexdigest()[:12]
    venv = root / f"recipe-{name}-venv-{key}"
    marker = venv / ".otel-capture-installed"
    with open(root / f"recipe-{name}-venv-{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return venv
        python = str(venv / "bin" / "python")
        for step in (
            [sys.executable, "-m", "venv", "--clear", str(venv)],
            [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *requirements],
        ):
            try:
                done = subprocess.run(
                    step, timeout=INSTALL_TIMEOUT, stdin=subprocess.DEVNULL, capture_output=True, text=True
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise ToolUnavailable(f"installing {' '.join(requirements)}: {exc}") from exc
            if done.returncode != 0:
                raise ToolUnavailable(
                    f"installing {' '.join(requirements)} failed ({done.returncode}): "
                    f"{(done.stdout + done.stderr)[-3000:]}"
                )
        marker.touch()
    return venv


def docs_block(after: str, language: str) -> str:
    """The first fenced ``language`` block after the text ``after`` in docs/gateways.md, as the page shows
    it (the recipe tests run what a reader copies)."""
    text = GATEWAYS.read_text()
    start = text.index(after)
    fence = f"```{language}\n"
    body = text.index(fence, start) + len(fence)
    return text[body : text.index("```", body)]
