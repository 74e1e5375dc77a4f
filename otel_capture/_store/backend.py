"""The capture lifecycle's verbs, spelled once (``docs/lifecycle.md``): what every backend offers.

Both backends declare :class:`CaptureBackend` (:class:`.store.CaptureStore` on files,
:class:`.memory.InMemoryCaptureBackend` in memory), so the type checker holds each to it, and the
conformance kit (:mod:`otel_capture.conformance`) checks a backend against it before it checks behaviour.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from .types import CaptureSnapshot, RemovalResult, RolloutState

__all__ = ["VERBS", "CaptureBackend"]


@runtime_checkable
class CaptureBackend(Protocol):
    """A lifecycle backend: write a rollout's calls, freeze it into a snapshot, drop, retire, delete."""

    def append_now(
        self,
        rollout_id: str,
        model_call_id: str,
        record: dict[str, Any],
        tokens: dict[str, Any] | None = None,
    ) -> None: ...
    def begin_call(self, rollout_id: str, model_call_id: str) -> None: ...
    def mark_incomplete(self, rollout_id: str, model_call_id: str, reason: str) -> None: ...
    def rollout_state(self, rollout_id: str) -> RolloutState: ...
    def list_rollouts(self, state: RolloutState | None = None) -> dict[str, RolloutState]: ...
    def freeze_now(self, rollout_id: str) -> CaptureSnapshot: ...
    def drop_now(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool: ...
    def retire_now(self, rollout_ids: Iterable[str]) -> RemovalResult: ...
    def delete_now(self, rollout_ids: Iterable[str]) -> RemovalResult: ...
    async def freeze(self, rollout_id: str) -> CaptureSnapshot: ...
    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool: ...
    async def retire(self, rollout_ids: Iterable[str]) -> RemovalResult: ...
    async def delete(self, rollout_ids: Iterable[str]) -> RemovalResult: ...


VERBS: tuple[str, ...] = tuple(
    name
    for name in CaptureBackend.__dict__
    if not name.startswith("_") and callable(getattr(CaptureBackend, name))
)
"""The verbs' names, in the order above (what the conformance kit reports missing)."""
