"""The ``otel-capture`` command as a user runs it: the installed console script and ``python -m otel_capture``
in their own processes, their help, ``--version``, ``ls`` (and ``show DIR``, its alias) and ``freeze``."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import otel_capture
from otel_capture import CaptureStore

SCRIPT = str(Path(sys.executable).with_name("otel-capture"))  # the console script pip installed
MODULE = [sys.executable, "-m", "otel_capture"]
BOUND = 60  # seconds: a bound on a hang, not a timing assertion


def run(*argv: str, via: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [*(via or [SCRIPT]), *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=BOUND, stdin=subprocess.DEVNULL)


def _subcommands() -> list[str]:
    """The subcommands ``otel-capture --help`` lists (its ``COMMAND`` block), as a user finds them."""
    listing = run("--help")
    assert listing.returncode == 0, listing.stderr
    block = listing.stdout.split("  COMMAND\n", 1)[1].split("\noptions:", 1)[0]
    return re.findall(r"^    (\w+)\s", block, re.MULTILINE)


def _description(help_text: str) -> str:
    """What a subcommand's ``--help`` says between its usage and its arguments, as one line."""
    after_usage = help_text.split("\n\n", 1)[1]
    return " ".join(after_usage.split("\n\n", 1)[0].split())


def test_the_help_lists_every_command() -> None:
    assert _subcommands() == ["proxy", "ls", "show", "check", "health", "freeze", "retire", "delete", "demo"]


@pytest.mark.parametrize(
    "command", ["proxy", "ls", "show", "check", "health", "freeze", "retire", "delete", "demo"]
)
def test_every_command_says_what_it_does_in_its_help(command: str) -> None:
    result = run(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: otel-capture {command} ")
    description = _description(result.stdout)
    assert not description.startswith(("positional arguments", "options")), result.stdout
    assert len(description.split()) >= 20, description  # a few sentences, not a label


def test_retire_and_delete_help_say_what_they_remove_and_keep() -> None:
    retire = _description(run("retire", "--help").stdout)
    assert "remove their records" in retire and "keep a fence" in retire and "late calls" in retire
    delete = _description(run("delete", "--help").stdout)
    assert "records, token lines and fences" in delete and "reused" in delete
    freeze = _description(run("freeze", "--help").stdout)
    assert "snapshot" in freeze and "refuse its new records" in freeze
    show = _description(run("show", "--help").stdout)
    assert "alias of 'ls DIR'" in show


@pytest.mark.parametrize("via", [[SCRIPT], MODULE], ids=["console script", "python -m"])
def test_version_is_the_package_version(via: list[str]) -> None:
    result = run("--version", via=via)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"otel-capture {otel_capture.__version__}\n"
    assert otel_capture.__version__ == version("otel-capture")  # the one version source


def test_python_m_is_the_same_command(tmp_path: Path) -> None:
    CaptureStore(tmp_path).append_now("r-0", "c1", {"model_call_id": "c1", "status_code": 200})
    by_script, by_module = run("ls", str(tmp_path)), run("ls", str(tmp_path), via=MODULE)
    assert by_script.returncode == by_module.returncode == 0
    assert by_module.stdout == by_script.stdout and "r-0" in by_module.stdout
    usage = run("retire", via=MODULE)
    assert usage.returncode == 2 and "usage: otel-capture retire" in usage.stderr


def _rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines()]


def test_ls_lists_each_rollout_with_its_state_and_calls_and_show_dir_is_its_alias(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    store.append_now("a", "c1", {"model_call_id": "c1", "status_code": 200, "usage": {}})
    store.append_now("a", "c2", {"model_call_id": "c2", "status_code": 500})
    store.append_now("b", "c1", {"model_call_id": "c1", "status_code": 200})
    store.freeze_now("b")
    store.retire_now(["gone"])
    listing = run("ls", str(tmp_path))
    assert listing.returncode == 0, listing.stderr
    header, *rows, note = _rows(listing.stdout)
    assert note[:6] == [
        "?:",
        "2",
        "call(s)",
        "of",
        "a,",
        "b",
    ]  # answered 200 without usage: unknown tokens, noted
    assert header[:8] == ["rollout", "state", "calls", "errors", "tokens", "in", "tokens", "out"]
    assert header[-2:] == ["incomplete", "damaged"]  # latency columns between (issue 33, item 12)
    assert [row[:4] for row in rows] == [
        ["a", "live", "2", "1"],
        ["b", "frozen", "1", "0"],
        ["gone", "retired", "0", "0"],
    ]
    alias = run("show", str(tmp_path))
    assert (alias.returncode, alias.stdout) == (0, listing.stdout)
    retired = run("ls", str(tmp_path), "--state", "retired")
    assert [row[:2] for row in _rows(retired.stdout)[1:]] == [["gone", "retired"]]
    bad = run("ls", str(tmp_path), "--state", "asleep")
    assert bad.returncode == 2 and "invalid choice: 'asleep'" in bad.stderr


def test_freeze_takes_a_snapshot_and_refuses_later_records(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    store.append_now("a", "c1", {"model_call_id": "c1"}, tokens={"model_call_id": "c1", "token_ids": [1]})
    store.append_now("a", "c2", {"model_call_id": "c2"})
    first = run("freeze", str(tmp_path), "a", "new")
    assert first.returncode == 0, first.stderr
    a, new = (line.split("\t") for line in first.stdout.splitlines())
    assert a[:5] == ["frozen", "a", "2 records", "1 token line", "complete"]
    assert new[:5] == ["frozen", "new", "0 records", "0 token lines", "complete"]  # an unseen id is fenced
    snapshot = store.freeze_now("a")  # what the library hands a trainer: the same snapshot
    assert a[5:] == [f"snapshot {snapshot.snapshot_id}", f"version {snapshot.version}"]
    assert store.list_rollouts() == {"a": "frozen", "new": "frozen"}
    with pytest.raises(otel_capture.CaptureFrozenError):
        store.append_now("a", "c3", {"model_call_id": "c3"})
    again = run("freeze", str(tmp_path), "a")
    assert (again.returncode, again.stdout.splitlines()) == (0, [first.stdout.splitlines()[0]])


def test_freeze_of_a_retired_rollout_fails_that_id_only_and_a_bad_id_changes_nothing(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    store.append_now("a", "c1", {"model_call_id": "c1"})
    store.retire_now(["old"])
    mixed = run("freeze", str(tmp_path), "old", "a")
    assert mixed.returncode == 1
    assert mixed.stderr.startswith("otel-capture: error: freeze old: ") and mixed.stderr.count("\n") == 1
    assert [line.split("\t")[:2] for line in mixed.stdout.splitlines()] == [["frozen", "a"]]
    assert store.list_rollouts() == {"a": "frozen", "old": "retired"}
    bad = run("freeze", str(tmp_path), "b", "not/an/id")
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.startswith("otel-capture: error: invalid rollout id 'not/an/id'")
    assert store.rollout_state("b") == "absent"  # validated whole first: nothing frozen
