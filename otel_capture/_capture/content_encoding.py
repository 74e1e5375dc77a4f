"""A response's ``Content-Encoding`` undone for the record only: the client gets the bytes as sent.

Some upstreams compress whatever ``Accept-Encoding`` says. The record keeps what the model produced, so a
gzip, deflate or br body is decoded chunk by chunk with the standard library's ``zlib`` and the ``brotli``
package (a core dependency): the same streaming decompressors httpx and aiohttp wrap. Any other encoding is
recorded as sent, with one warning per encoding (contract D30).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from typing import Protocol

import brotli  # type: ignore[import-untyped]

_logger = logging.getLogger(__name__)
_warned: set[str] = set()  # encodings already logged as undecodable (once each, not once per call)


class _Decoder(Protocol):
    def decode(self, chunk: bytes) -> bytes: ...


class _Zlib:
    """gzip (``wbits`` 16 + 15), or deflate: zlib-wrapped as RFC 9110 says, or raw as some servers send it,
    told apart by the zlib header's check bits (RFC 1950) once two bytes have come."""

    __slots__ = ("_decompressor", "_head")

    def __init__(self, gzip: bool) -> None:
        self._head: bytes | None = None if gzip else b""
        self._decompressor = zlib.decompressobj(zlib.MAX_WBITS | 16) if gzip else None

    def decode(self, chunk: bytes) -> bytes:
        if self._head is not None:  # deflate, its kind not known yet
            chunk = self._head + chunk
            if len(chunk) < 2:
                self._head = chunk
                return b""
            self._head = None
            wrapped = chunk[0] & 0x0F == 8 and (chunk[0] << 8 | chunk[1]) % 31 == 0
            self._decompressor = zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
        assert self._decompressor is not None
        return self._decompressor.decompress(chunk)


class _Brotli:
    __slots__ = ("_decompressor",)

    def __init__(self) -> None:
        self._decompressor = brotli.Decompressor()

    def decode(self, chunk: bytes) -> bytes:
        return bytes(self._decompressor.process(chunk)) if chunk else b""


class _Chain:
    """Several encodings, undone last-applied first."""

    __slots__ = ("_decoders",)

    def __init__(self, decoders: list[_Decoder]) -> None:
        self._decoders = decoders[::-1]

    def decode(self, chunk: bytes) -> bytes:
        for decoder in self._decoders:
            chunk = decoder.decode(chunk)
        return chunk


_DECODERS: dict[str, Callable[[], _Decoder]] = {
    "gzip": lambda: _Zlib(gzip=True),
    "x-gzip": lambda: _Zlib(gzip=True),
    "deflate": lambda: _Zlib(gzip=False),
    "br": _Brotli,
}


class ResponseDecoding:
    """Decodes one response body as it arrives. From a damaged chunk on, the bytes pass as they came and
    ``failed`` is set: the record's copy is then flagged as not the whole answer, and does not parse."""

    __slots__ = ("_decoder", "encoding", "failed")

    def __init__(self, encoding: str, decoder: _Decoder) -> None:
        self.encoding = encoding
        self._decoder = decoder
        self.failed = False

    def decode(self, chunk: bytes) -> bytes:
        if self.failed:
            return chunk
        try:
            return self._decoder.decode(chunk)
        except (zlib.error, brotli.error) as exc:
            self.failed = True
            _logger.warning(
                "a %s response body did not decode (%s); its record keeps it as sent", self.encoding, exc
            )
            return chunk


def decoding_for(content_encoding: str) -> ResponseDecoding | None:
    """The decoder for a ``Content-Encoding`` header value (encodings in the order applied), or None when
    there is nothing to undo or an encoding is unknown here (the record then keeps the bytes as sent)."""
    names = [name.strip().lower() for name in content_encoding.split(",")]
    names = [name for name in names if name and name != "identity"]
    if not names:
        return None
    unknown = [name for name in names if name not in _DECODERS]
    if unknown:
        if content_encoding not in _warned:
            _warned.add(content_encoding)
            _logger.warning(
                "responses with content-encoding %r are recorded as sent: no decoder here", content_encoding
            )
        return None
    decoders: list[_Decoder] = [_DECODERS[name]() for name in names]
    return ResponseDecoding(content_encoding.strip(), decoders[0] if len(decoders) == 1 else _Chain(decoders))
