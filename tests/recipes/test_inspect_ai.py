"""The inspect-ai recipe of docs/gateways.md: its solver, as the page shows it, in two evals that share one
capture directory (two tasks, sample ids ``1`` and ``"city 9"``, two epochs), with inspect-ai 0.3.285's
OpenAI provider against the capture proxy and the real tiny model behind it.

Every sample run is its own rollout with its one call: the ids differ between the evals (the page's first
recipe, ``f"{sample_id}-{epoch}"``, mixed both evals in rollout ``1-1``), and ``"city 9"``, outside the
rollout id grammar, still gives one that fits, so no call fails and none goes unrecorded.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from tool_venvs import INSPECT_AI, CaptureProxy, docs_block

from otel_capture import ROLLOUT_ID_PATTERN, read_model_call_records

pytestmark = pytest.mark.recipes

# Run in inspect-ai's venv: the page's solver (argv[1], a file), two evals of two samples and two epochs.
_EVALS = r"""
import json, sys

from inspect_ai import Task, eval as inspect_eval
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes

recipe, base_url, log_dir = sys.argv[1:4]
exec(compile(open(recipe).read(), "docs/gateways.md (inspect-ai recipe)", "exec"))


def task(name: str) -> Task:
    samples = [Sample(id=1, input="Say hi", target="hi"), Sample(id="city 9", input="Name a city", target="Paris")]
    return Task(name=name, dataset=samples, solver=[generate_with_rollout_id()], scorer=includes(), epochs=2)


logs = inspect_eval(
    [task("eval_a"), task("eval_b")], model="openai/policy", model_base_url=base_url, log_dir=log_dir,
    max_tokens=4, display="none", max_retries=0,
    model_args={"responses_api": False},  # the page's -M responses_api=false: llama.cpp's Chat Completions
)
print(json.dumps([
    {"status": log.status, "error": str(log.error),
     "samples": [[s.id, s.epoch, s.uuid, str(s.error)] for s in (log.samples or [])]}
    for log in logs
]))
"""


def test_two_evals_sharing_a_directory_get_one_rollout_per_sample_run(
    tool: Callable[[str, list[str]], Path], start_capture_proxy: Callable[..., CaptureProxy], tmp_path: Path
) -> None:
    venv = tool("inspect-ai", INSPECT_AI)
    capture = start_capture_proxy()
    recipe = tmp_path / "recipe.py"
    recipe.write_text(docs_block("**inspect-ai**", "python"))
    done = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            _EVALS,
            str(recipe),
            f"{capture.url}/v1",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OPENAI_API_KEY": "EMPTY"},
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    evals = json.loads(done.stdout.strip().splitlines()[-1])
    assert [e["status"] for e in evals] == ["success", "success"], evals
    runs = [sample for e in evals for sample in e["samples"]]
    assert len(runs) == 8 and all(error == "None" for *_, error in runs), runs
    expected = {
        f"{re.sub(r'[^A-Za-z0-9._-]+', '_', str(sample_id))}-e{epoch}-{uuid}": sample_id
        for sample_id, epoch, uuid, _ in runs
    }
    assert len(expected) == 8  # unique per sample, epoch and eval
    assert all(re.fullmatch(ROLLOUT_ID_PATTERN, rollout_id) for rollout_id in expected)
    assert capture.store.rollout_ids() == sorted(expected)  # "city 9" included: none went unrecorded
    for rollout_id in expected:
        [record] = read_model_call_records(capture.store, rollout_id)
        assert record.status_code == 200
