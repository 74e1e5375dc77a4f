"""The names of a capture directory's files: every one the store reads or writes, here and nowhere else.

``<dir>/`` (NeMo Gym reads these)::

    <rollout_id>.capture.jsonl       one ModelCallRecord line per call          CAPTURE_SUFFIX
    <rollout_id>.tokens.jsonl        one token line per call that had tokens    TOKENS_SUFFIX
    <rollout_id>.capture.incomplete  exists when a call was not captured        INCOMPLETE_SUFFIX
    .uncorrelated.<host>.<pid>.<start>.json   calls served without a rollout id (UNCORRELATED_*)

``<dir>/.otel-capture/`` (ours; NeMo Gym never looks)::

    locks/NN.lock                    a rollout's stripe lock                    LOCKS_DIR
    journal.lock, fences.journal     the fence journal                          JOURNAL_LOCK, JOURNAL
    inflight/<rollout_id>.calls      calls in flight, for other processes       INFLIGHT_DIR, INFLIGHT_SUFFIX
    trash/                           record files a retire or delete moved out  TRASH_DIR
    losses/<writer>.losses           a writer's loss reserve                    LOSSES_DIR, LOSSES_SUFFIX
    weight_versions                  the declared weight versions               WEIGHT_VERSIONS
"""

from __future__ import annotations

CAPTURE_SUFFIX = ".capture.jsonl"
INCOMPLETE_SUFFIX = ".capture.incomplete"
TOKENS_SUFFIX = ".tokens.jsonl"
RECORD_SUFFIXES = (CAPTURE_SUFFIX, INCOMPLETE_SUFFIX, TOKENS_SUFFIX)
"""A rollout's files in the capture directory: what retire and delete remove."""

UNCORRELATED_PREFIX = ".uncorrelated."
UNCORRELATED_SUFFIX = ".json"

STATE_DIR = ".otel-capture"
LOCKS_DIR = "locks"
INFLIGHT_DIR = "inflight"
TRASH_DIR = "trash"
LOSSES_DIR = "losses"
STATE_SUBDIRS = (LOCKS_DIR, INFLIGHT_DIR, TRASH_DIR, LOSSES_DIR)
"""Made whole ahead of need (:meth:`.dirstate.DirState.prepare`)."""

JOURNAL = "fences.journal"
JOURNAL_LOCK = "journal.lock"
INFLIGHT_SUFFIX = ".calls"
LOSSES_SUFFIX = ".losses"
WEIGHT_VERSIONS = "weight_versions"


def state_label(*parts: str) -> str:
    """How a state entry is named in messages: ``.otel-capture/<parts...>``."""
    return "/".join((STATE_DIR, *parts))
