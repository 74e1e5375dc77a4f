"""``show``'s weight column: the admitted version, the declared change, the engine's version and its
change, the engine's pauses the call waited through."""

from __future__ import annotations

from typing import Any

import pytest

from otel_capture import ModelCallRecord
from otel_capture._cli.show import weight_cell


@pytest.mark.parametrize(
    ("fields", "cell"),
    [
        ({}, "-"),
        ({"weight_version": "7"}, "7"),
        ({"weight_version": "7", "weight_version_at_end": "8"}, "7->8"),
        ({"weight_version": "7", "engine_weight_version": "7"}, "7"),
        ({"weight_version": "8", "engine_weight_version": "7"}, "8 (engine 7)"),
        ({"engine_weight_version": "7"}, "- (engine 7)"),
        (
            {"weight_version": "7", "engine_weight_version": "7", "engine_weight_version_at_end": "8"},
            "7 (engine 7->8)",
        ),
        (
            {
                "engine_weight_version": "7",
                "engine_weight_version_at_end": "8",
                "engine_pauses": [{"mode": "keep", "paused_at": 1.0, "resumed_at": 2.0}],
            },
            "- (engine 7->8, 1 pause)",
        ),
        ({"weight_version": "7", "engine_pauses": [{"mode": "abort"}, {"mode": "keep"}]}, "7 (2 pauses)"),
    ],
)
def test_the_weight_cell_says_every_version_the_call_ran_under(fields: dict[str, Any], cell: str) -> None:
    assert weight_cell(ModelCallRecord(call_index=0, **fields)) == cell
