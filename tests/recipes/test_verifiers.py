"""The verifiers recipe of docs/gateways.md, with verifiers 0.4.0's own model client (``EvalClient``, which
``vf-eval`` sends every model call through, with the rollout's trace id as ``X-Session-ID``) in front of the
capture proxy, started as the page shows it, and the real tiny model behind it.

With ``OTEL_CAPTURE_SESSION_ID_AS_ROLLOUT=true`` and the plain base URL each rollout is one file; with a
``/ng-rollout/<id>`` prefix left in the base URL (what the recipe says to drop) the prefix wins and every
rollout lands in that one file.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from tool_venvs import VERIFIERS, CaptureProxy, docs_block

from otel_capture import read_model_call_records

pytestmark = pytest.mark.recipes

# Run in verifiers' venv: ROLLOUTS rollouts of two chat calls each, through verifiers' EvalClient, each
# rollout with a trace id made as verifiers makes it (Trace.id's factory); prints the ids.
_AGENT = r"""
import asyncio, json, sys

from verifiers.v1.clients.client import resolve_client
from verifiers.v1.configs.client import EvalClientConfig
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.trace import Trace
from verifiers.v1.types import SamplingConfig

base_url, rollouts = sys.argv[1], int(sys.argv[2])


async def main() -> None:
    client = resolve_client(EvalClientConfig(base_url=base_url, api_key_var="OPENAI_API_KEY"))
    ids = []
    for index in range(rollouts):
        trace_id = Trace.model_fields["id"].default_factory()
        for turn in range(2):
            body = {"model": "policy", "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"rollout {index} turn {turn}: hi"}]}
            await client.get_response(ChatDialect(), body, SamplingConfig(), session_id=trace_id)
        ids.append(trace_id)
    await client.close()
    print(json.dumps(ids))


asyncio.run(main())
"""


def _proxy_env() -> dict[str, str]:
    """The variables of the page's command that starts the capture proxy for verifiers."""
    block = docs_block("**verifiers**", "bash")
    return dict(word.split("=", 1) for word in block.split() if "=" in word and word[:1].isupper())


def _run_agent(venv: Path, base_url: str, rollouts: int) -> list[str]:
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _AGENT, base_url, str(rollouts)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "OPENAI_API_KEY": "EMPTY", "HOME": str(Path.home())},
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    ids: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return ids


def test_each_verifiers_rollout_lands_in_its_own_file(
    tool: Callable[[str, list[str]], Path], start_capture_proxy: Callable[..., CaptureProxy]
) -> None:
    venv = tool("verifiers", VERIFIERS)
    env = _proxy_env()
    assert env == {"OTEL_CAPTURE_SESSION_ID_AS_ROLLOUT": "true"}
    capture = start_capture_proxy(**env)
    ids = _run_agent(venv, f"{capture.url}/v1", rollouts=3)
    assert len(set(ids)) == 3
    assert capture.store.rollout_ids() == sorted(ids)
    for trace_id in ids:
        records = read_model_call_records(capture.store, trace_id)
        assert [r.status_code for r in records] == [200, 200]
        assert [r.client_session_id for r in records] == [trace_id, trace_id]


def test_a_prefix_left_in_the_base_url_puts_every_rollout_in_one_file(
    tool: Callable[[str, list[str]], Path], start_capture_proxy: Callable[..., CaptureProxy]
) -> None:
    """Why the recipe says to drop the prefix: it comes first in the correlation order."""
    venv = tool("verifiers", VERIFIERS)
    capture = start_capture_proxy(**_proxy_env())
    ids = _run_agent(venv, f"{capture.url}/ng-rollout/eval-1/v1", rollouts=3)
    assert capture.store.rollout_ids() == ["eval-1"]
    records = read_model_call_records(capture.store, "eval-1")
    assert sorted({r.client_session_id for r in records}) == sorted(ids)  # three rollouts, one file
