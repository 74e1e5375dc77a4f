"""A response's ``Content-Encoding`` undone for the record only: the client gets the bytes as sent.

Some upstreams compress whatever ``Accept-Encoding`` says. The record keeps what the model produced, so a
gzip, deflate, br (or zstd, when ``zstandard`` is installed) body is decoded chunk by chunk with httpx's
own decoders, the ones the OpenAI and Anthropic SDKs decode the same bytes with.
"""

from __future__ import annotations

import logging

import httpx

# httpx's decoder classes are the library's own (what ``Response.iter_bytes`` uses); they are reached by
# their module because httpx exports only the error type.
from httpx._decoders import SUPPORTED_DECODERS, ContentDecoder, MultiDecoder

_logger = logging.getLogger(__name__)
_warned: set[str] = set()  # encodings already logged as undecodable (once each, not once per call)


class ResponseDecoding:
    """Decodes one response body as it arrives. From a damaged chunk on, the bytes pass as they came and
    ``failed`` is set: the record's copy is then flagged as not the whole answer, and does not parse."""

    __slots__ = ("_decoder", "encoding", "failed")

    def __init__(self, encoding: str, decoder: ContentDecoder) -> None:
        self.encoding = encoding
        self._decoder = decoder
        self.failed = False

    def decode(self, chunk: bytes) -> bytes:
        if self.failed:
            return chunk
        try:
            return self._decoder.decode(chunk)
        except httpx.DecodingError as exc:
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
    unknown = [name for name in names if name not in SUPPORTED_DECODERS]
    if unknown:
        if content_encoding not in _warned:
            _warned.add(content_encoding)
            _logger.warning(
                "responses with content-encoding %r are recorded as sent: no decoder here", content_encoding
            )
        return None
    decoders = [SUPPORTED_DECODERS[name]() for name in names]
    decoder = decoders[0] if len(decoders) == 1 else MultiDecoder(decoders)
    return ResponseDecoding(content_encoding.strip(), decoder)
