"""Usage from a compressed (`Content-Encoding`) answer, within a bound.

A host's answer may be small on the wire and huge decoded. It is decoded here piece by piece, up to
a cap on the decoded size, keeping only the parts `usage_from_body` reads (`AnswerEdges`): memory
stays a few hundred KiB whatever the answer holds. Decoding is CPU work that scales with the
answer, so callers run it on a worker thread. What the client receives is never touched.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from crossbar.tap import AnswerEdges, Usage

DECODE_STEP = 1 << 20  # decoded bytes produced per step
_WBITS = {"gzip": (31,), "x-gzip": (31,), "deflate": (15, -15)}  # deflate: zlib-wrapped, else raw


class OverCap(Exception):
    pass


@dataclass(frozen=True, slots=True)
class EncodedUsage:
    usage: Usage | None
    unread: str = ""  # why usage could not be read ("" when it was, or the answer had none)


def _inflate(raw: bytes, wbits: int, cap: int) -> AnswerEdges:
    edges = AnswerEdges()
    inflater = zlib.decompressobj(wbits)
    data = raw
    while True:
        piece = inflater.decompress(data, DECODE_STEP)
        edges.add(piece)
        if edges.total > cap:
            raise OverCap
        data = inflater.unconsumed_tail
        if inflater.eof:
            data = inflater.unused_data
            if not data:
                return edges
            inflater = zlib.decompressobj(wbits)  # a further gzip member
        elif not data and not piece:
            raise zlib.error("the compressed data ends early")


def usage_of_encoded(raw: bytes, encoding: str, cap: int) -> EncodedUsage:
    """Usage from an answer `raw` sent with `Content-Encoding: encoding`, decoding at most `cap`
    bytes. Encodings other than gzip and deflate are not decoded."""
    tried = _WBITS.get(encoding.strip().lower())
    if tried is None:
        return EncodedUsage(None, f"not read from a {encoding[:32]!r}-encoded answer")
    for wbits in tried:
        try:
            return EncodedUsage(_inflate(raw, wbits, cap).usage())
        except OverCap:
            return EncodedUsage(None, f"not read from an answer over {cap} bytes decoded")
        except zlib.error:
            continue
    return EncodedUsage(None, f"not read from an answer that does not decode as {encoding[:32]!r}")
