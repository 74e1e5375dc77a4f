"""``otel-capture health DIR [DIR...] [--rollout ID ...] [--summary FILE]``: each rollout's verdict.

One line per rollout that is not healthy (its id, its verdict, the checks that fired), then
``Rollout health: N checked, H healthy, U unhealthy, O unobserved``; exit 0 when every checked rollout is
healthy, else 1. ``--summary`` writes the whole result as JSON (docs/attachment.md, "Rollout health").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_UNHEALTHY = 1


def add_parser(commands: Any) -> None:
    """Add ``health`` to the command line's subcommands."""
    health = commands.add_parser(
        "health",
        help="each rollout's verdict: healthy, unhealthy or unobserved, from named checks over its calls",
        description=(
            "Judge each rollout captured in the directories (read as they are: nothing is frozen or "
            "changed): one line per rollout that is not healthy, then the counts. Exit 0 when every "
            "checked rollout is healthy, 1 otherwise. The checks are listed in docs/attachment.md."
        ),
    )
    health.add_argument("dirs", nargs="+", metavar="DIR", help="capture directories (one per node)")
    health.add_argument(
        "--rollout",
        action="append",
        dest="rollouts",
        metavar="ID",
        help="judge this rollout (repeatable; one never captured is unobserved); default: every rollout",
    )
    health.add_argument("--summary", metavar="FILE", help="write the verdicts and their checks as JSON")


def line_of(rollout_id: str, result: dict[str, Any]) -> str:
    """``<id>: <verdict>: check, check (reported: check)``."""
    from .._health import UNHEALTHY_CHECKS

    names = [c["name"] for c in result["checks"]]
    unhealthy = [n for n in names if n in UNHEALTHY_CHECKS]
    reported = [n for n in names if n not in UNHEALTHY_CHECKS]
    text = f"{rollout_id}: {result['verdict']}"
    if unhealthy:
        text += ": " + ", ".join(unhealthy)
    if reported:
        text += f" (reported: {', '.join(reported)})"
    return text


def counts_line(summary: dict[str, Any]) -> str:
    return (
        f"Rollout health: {summary['checked']} checked, {summary['healthy']} healthy, "
        f"{summary['unhealthy']} unhealthy, {summary['unobserved']} unobserved"
    )


def _write_json(path: str, value: dict[str, Any]) -> None:
    """Written whole or not at all: a temporary file beside it, renamed over it."""
    target = Path(path)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(value, out, indent=2, sort_keys=False)
            out.write("\n")
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def run(args: argparse.Namespace) -> int:
    from .._health import health_summary

    for directory in args.dirs:
        if not Path(directory).is_dir():
            print(f"otel-capture: error: {directory} is not a directory", file=sys.stderr)
            return EXIT_UNHEALTHY
    summary = health_summary(args.dirs, args.rollouts)
    for rollout_id, result in summary["rollouts"].items():
        if result["verdict"] != "healthy":
            print(line_of(rollout_id, result))
    print(counts_line(summary))
    if args.summary:
        _write_json(args.summary, summary)
    return EXIT_OK if summary["healthy"] == summary["checked"] else EXIT_UNHEALTHY
