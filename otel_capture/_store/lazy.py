"""A snapshot's lines, kept as the file's bytes and parsed on access (issue 15: memory at scale).

A frozen 100,000-call rollout held as parsed ``ModelCallRecord``s costs about 12 KB of Python objects per
line (5-10x the file); held as one ``bytes`` buffer plus 24 bytes of offsets per line it costs about the
file's size. :class:`LazyLines` is a read-only ``Sequence`` over such a buffer: ``len``, indexing, slicing
and iteration parse each line when it is asked for, with the parser the freeze validated it with (the
readers' own, for records), so every access sees the same value a tuple of parsed lines would hold.
It compares equal to a tuple (or list, or another ``LazyLines``) of equal values.

Nothing is cached: a record asked for twice is parsed twice (equal, not the same object), so holding the
sequence never grows it. A caller that wants the records as objects makes ``list(snap.records)``.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar, overload

__all__ = ["LazyLines", "LineParser"]

_T = TypeVar("_T")
LineParser = Callable[[bytes, int], Any]
"""``parse(line, index) -> value or None``: module-level, so a snapshot stays picklable."""

_SUMMARY_OVER = 20  # a repr of more values than this names their count instead of listing them


class LazyLines(Sequence[_T], Generic[_T]):
    """The lines ``data[start:end]`` of ``spans`` (``start, end, index`` triples), each parsed on access
    by ``parse(line, index)``. ``spans`` must name lines ``parse`` accepted (returned a value for)
    (contract L19)."""

    __slots__ = ("_data", "_parse", "_spans")

    def __init__(self, data: bytes, spans: array[int], parse: LineParser) -> None:
        self._data = data
        self._spans = spans
        self._parse = parse

    def __len__(self) -> int:
        return len(self._spans) // 3

    def _at(self, i: int) -> _T:
        start, end, index = self._spans[3 * i : 3 * i + 3]
        value = self._parse(self._data[start:end], index)
        if value is None:  # validated by the freeze: only a parser that changed its mind gets here
            raise ValueError(f"line {index} no longer parses")
        result: _T = value
        return result

    @overload
    def __getitem__(self, i: int) -> _T: ...

    @overload
    def __getitem__(self, i: slice) -> LazyLines[_T]: ...

    def __getitem__(self, i: int | slice) -> _T | LazyLines[_T]:
        n = len(self)
        if isinstance(i, slice):
            spans = array("q")
            for j in range(*i.indices(n)):
                spans.extend(self._spans[3 * j : 3 * j + 3])
            return LazyLines(self._data, spans, self._parse)
        j = i.__index__()
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError("snapshot index out of range")
        return self._at(j)

    def __iter__(self) -> Iterator[_T]:
        for i in range(len(self)):
            yield self._at(i)

    def __reversed__(self) -> Iterator[_T]:
        for i in range(len(self) - 1, -1, -1):
            yield self._at(i)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyLines):
            if len(self) != len(other):
                return False
            if self._data is other._data and self._spans == other._spans and self._parse is other._parse:
                return True
            return all(a == b for a, b in zip(self, other, strict=True))
        if isinstance(other, (tuple, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash(tuple(self))  # as a tuple of the values would (unhashable values raise TypeError)

    def __repr__(self) -> str:
        if len(self) > _SUMMARY_OVER:
            return f"<{len(self)} lines of {len(self._data)} bytes, parsed on access>"
        return repr(tuple(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (LazyLines, (self._data, self._spans, self._parse))


def empty_lines(parse: LineParser) -> LazyLines[Any]:
    return LazyLines(b"", array("q"), parse)
