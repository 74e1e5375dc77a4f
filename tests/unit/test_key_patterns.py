"""The API key's rollout pattern (``OTEL_CAPTURE_API_KEY_ROLLOUT_PATTERN``), the pure parts: matched in
time linear in the key whatever the pattern (issue 30 item 1), and refused at start when it cannot be
matched safely or when its group could be a whole key (issue 33 items 2 and 3). End to end, through the
proxy and its command: tests/integration/test_refused_settings.py."""

from __future__ import annotations

import re

import pytest

from otel_capture import CaptureSettings
from otel_capture._correlation import RolloutRules
from otel_capture._correlation.ids import match_api_key
from otel_capture._errors import CaptureError, ConfigurationError
from otel_capture._key_pattern import ApiKeyRolloutPattern

ENV = "OTEL_CAPTURE_API_KEY_ROLLOUT_PATTERN"
# Patterns that backtrack catastrophically with Python's re on a key that almost matches: each holds the
# loop for seconds at ~25 letters and doubles (or worse) per letter; at 60 letters, for years.
PATHOLOGICAL = [
    r"rk-(?P<rollout>(?:[A-Za-z0-9]+-?)+)\.[A-Za-z0-9]+",  # the "dash-separated words"
    r"rk-(?P<rollout>(a+)+)b",
    r"rk-(?P<rollout>(a|aa)+)b",
    r"rk-(?P<rollout>(a|a?)+)b",
    r"rk-(?P<rollout>(.*a){12})b",
]
ALMOST = "rk-" + "a" * 60 + "!"


def _headers(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


@pytest.mark.parametrize("pattern", PATHOLOGICAL)
def test_a_pathological_pattern_answers_a_key_that_almost_matches_at_once(pattern: str) -> None:
    compiled = ApiKeyRolloutPattern.compile(pattern)
    # finishes: with backtracking this call would not return within the test run
    assert compiled.rollout_group(ALMOST) == (False, None)
    assert match_api_key(_headers(ALMOST), RolloutRules(compiled)) is None
    # and much longer keys too (a header line may be up to 64 KiB)
    assert compiled.rollout_group("rk-" + "a" * 65_000 + "!") == (False, None)


def test_the_pathological_pattern_still_reads_the_ids_it_was_written_for() -> None:
    compiled = ApiKeyRolloutPattern.compile(PATHOLOGICAL[0])
    match = match_api_key(_headers("rk-grpo-step-12-r-7.S3cret"), RolloutRules(compiled))
    assert match is not None and match.rollout_id == "grpo-step-12-r-7"


@pytest.mark.parametrize(
    "pattern",
    [
        r"(?P<rollout>[A-Za-z0-9._-]+)",  # the pattern the docs used to suggest: every key matches
        r"(?P<rollout>.+)",
        r"^(?P<rollout>\w+)$",  # anchors are no text
        r"(?:rk-)?(?P<rollout>[\w-]+)",  # an optional prefix: absent, the group is the key
        r"(?:rk-){0}(?P<rollout>[\w-]+)",
        r"(?P<rollout>[\w-]+)(?:\.x)*",
        r"rk-(?P<rollout>[\w-]+)|[\w-]+",  # a branch without the prefix
        r"(?P<rollout>rk-[\w-]+)",  # the fixed text inside the group is in the id, key and all
        r"[a-z]{2}(?P<rollout>-[\w-]+)",  # any two letters: a class, not a fixed text
    ],
)
def test_a_group_that_could_be_the_whole_key_is_refused_naming_the_variable(pattern: str) -> None:
    with pytest.raises(ConfigurationError, match=rf"^{ENV}: .*could be the whole key") as refused:
        CaptureSettings.from_environ({ENV: pattern})
    assert isinstance(refused.value, CaptureError) and isinstance(refused.value, ValueError)
    with pytest.raises(ConfigurationError, match=r"^api_key_rollout_pattern: .*could be the whole key"):
        CaptureSettings(api_key_rollout_pattern=pattern)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pattern", "key", "rollout_id"),
    [
        (r"rk-(?P<rollout>[A-Za-z0-9._-]+)", "rk-areal-0", "areal-0"),
        (r"rk-(?P<rollout>[A-Za-z0-9_-]+)\.[A-Za-z0-9]+", "rk-r-7.S3cret", "r-7"),
        (r"(?P<rollout>[A-Za-z0-9_-]+)\.rollout-key", "slime-3.rollout-key", "slime-3"),
        (r"(?:rk-)(?P<rollout>\w+)", "rk-a1", "a1"),
        (r"(?:rk|rollout)-(?P<rollout>\w+)", "rollout-a1", "a1"),  # the branches differ, the - is fixed
        (r"(?i)RK-(?P<rollout>\w+)", "rk-a1", "a1"),
    ],
)
def test_a_fixed_text_outside_the_group_is_accepted_and_no_whole_key_becomes_an_id(
    pattern: str, key: str, rollout_id: str
) -> None:
    settings = CaptureSettings.from_environ({ENV: pattern})
    assert settings.api_key_rollout_pattern is not None
    assert settings.api_key_rollout_pattern.rollout_group(key) == (True, rollout_id)
    # the keys of issue 33 are not read as ids by any accepted pattern
    for real_key in ("EMPTY", "sk-proj-abc123", "sk-ant-api03-abc", rollout_id):
        _, group = settings.api_key_rollout_pattern.rollout_group(real_key)
        assert group != real_key


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        (r"rk-([\w-]+)", r"named group \(\?P<rollout>"),
        (r"rk-(?P<id>[\w-]+)", r"named group \(\?P<rollout>"),
        ("rk-(?P<rollout>[", "not a regular expression"),
        (r"rk-(?P<rollout>a)\1", "RE2 cannot compile it .*no backreferences, lookaround"),
        (r"rk-(?=x)(?P<rollout>\w+)", "RE2 cannot compile it"),
        (r"rk-(?P<rollout>\w+)(?<!x)", "RE2 cannot compile it"),
        (r"rk-(?P<rollout>[[:alpha:]]+)", "Python's re and RE2 would read it differently"),
        (r"rk-(?P<rollout>(((a{100}){100}){100}))", "RE2 cannot compile it"),  # over RE2's memory budget
    ],
)
def test_a_pattern_that_cannot_be_used_is_refused_at_start_naming_the_variable(
    pattern: str, why: str
) -> None:
    # it used to be logged and replaced by "no pattern": the proxy started and every call went unrecorded
    with pytest.raises(ConfigurationError, match=rf"^{ENV}: .*{why}"):
        CaptureSettings.from_environ({ENV: pattern})


def test_a_compiled_re_pattern_is_taken_as_its_text_and_flags() -> None:
    settings = CaptureSettings(api_key_rollout_pattern=re.compile(r"rk-(?P<rollout>\w+)", re.IGNORECASE))  # type: ignore[arg-type]
    assert settings.api_key_rollout_pattern is not None
    assert settings.api_key_rollout_pattern.rollout_group("RK-a1") == (True, "a1")
    with pytest.raises(ConfigurationError, match="only the flags"):
        CaptureSettings(api_key_rollout_pattern=re.compile(r"rk- (?P<rollout>\w+)", re.VERBOSE))  # type: ignore[arg-type]


def test_the_error_line_is_one_line() -> None:
    with pytest.raises(ConfigurationError) as refused:
        CaptureSettings.from_environ({ENV: "(?P<rollout>.+)\n"})  # trailing blanks are dropped first
    assert "\n" not in str(refused.value)
