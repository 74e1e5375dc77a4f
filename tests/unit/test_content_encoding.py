"""The record's copy of a compressed answer is decoded chunk by chunk, whatever the chunk boundaries."""

from __future__ import annotations

import gzip
import zlib

import brotli
import pytest

from otel_capture._capture.content_encoding import decoding_for

BODY = b'{"choices":[{"message":{"content":"' + b"tokens " * 2000 + b'"}}]}'


def _raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


@pytest.mark.parametrize(
    ("encoding", "encoded"),
    [
        ("gzip", gzip.compress(BODY)),
        ("x-gzip", gzip.compress(BODY)),
        ("deflate", zlib.compress(BODY)),
        ("deflate", _raw_deflate(BODY)),  # what some servers send for deflate
        ("br", brotli.compress(BODY)),
        ("gzip, br", brotli.compress(gzip.compress(BODY))),  # applied in order, undone in reverse
        ("identity, GZIP", gzip.compress(BODY)),
    ],
)
@pytest.mark.parametrize("size", [1, 7, 4096])
def test_a_compressed_body_decodes_whatever_its_chunks(encoding: str, encoded: bytes, size: int) -> None:
    decoding = decoding_for(encoding)
    assert decoding is not None
    decoded = b"".join(decoding.decode(encoded[i : i + size]) for i in range(0, len(encoded), size))
    assert decoded == BODY and not decoding.failed


def test_a_damaged_body_passes_as_sent_from_the_damage_on() -> None:
    decoding = decoding_for("gzip")
    assert decoding is not None
    assert decoding.decode(b"not gzip at all") == b"not gzip at all"
    assert decoding.failed
    assert decoding.decode(b"more") == b"more"


def test_nothing_to_undo_or_an_unknown_encoding_records_the_bytes_as_sent() -> None:
    assert decoding_for("") is None
    assert decoding_for("identity") is None
    assert decoding_for("zstd") is None
    assert decoding_for("gzip, compress") is None
