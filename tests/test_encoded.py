"""Usage from a compressed answer: read within a bound on the decoded size, keeping only edges."""

from __future__ import annotations

import gzip
import json
import tracemalloc
import zlib

import pytest

from crossbar.encoded import usage_of_encoded
from crossbar.tap import Usage

REPLY = json.dumps({"choices": [{"message": {"content": "ok"}}],
                    "usage": {"prompt_tokens": 7, "completion_tokens": 3}}).encode()
LARGE = json.dumps({"choices": [{"message": {"content": "x" * (3 << 20)}}],
                    "usage": {"prompt_tokens": 9, "completion_tokens": 2}}).encode()
CAP = 8 << 20


def deflate(data: bytes, wbits: int) -> bytes:
    packer = zlib.compressobj(6, zlib.DEFLATED, wbits)
    return packer.compress(data) + packer.flush()


def bomb(decoded_mib: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    mib = b"a" * (1 << 20)
    return b"".join([packer.compress(b'{"x":"'), *(packer.compress(mib) for _ in range(decoded_mib)),
                     packer.compress(b'"}'), packer.flush()])


@pytest.mark.parametrize(("raw", "encoding", "usage"), [
    (gzip.compress(REPLY), "gzip", Usage(7, None, 3)),
    (gzip.compress(REPLY), " GZIP ", Usage(7, None, 3)),
    (gzip.compress(REPLY[:40]) + gzip.compress(REPLY[40:]), "gzip", Usage(7, None, 3)),  # two members
    (deflate(REPLY, 15), "deflate", Usage(7, None, 3)),
    (deflate(REPLY, -15), "deflate", Usage(7, None, 3)),  # raw deflate, as some servers send it
    (gzip.compress(LARGE), "gzip", Usage(9, None, 2)),  # read at its edges, as an identity answer is
    (gzip.compress(b'{"choices": []}'), "gzip", None),
])
def test_usage_is_read_from_a_compressed_answer(raw: bytes, encoding: str, usage: Usage | None) -> None:
    found = usage_of_encoded(raw, encoding, CAP)
    assert (found.usage, found.unread) == (usage, "")


@pytest.mark.parametrize(("raw", "encoding", "why"), [
    (gzip.compress(REPLY)[:-12], "gzip", "does not decode"),  # cut short
    (gzip.compress(REPLY) + b"junk", "gzip", "does not decode"),
    (b"not compressed", "deflate", "does not decode"),
    (REPLY, "br", "'br'-encoded"),
    (gzip.compress(LARGE), "gzip", "over 1048576 bytes decoded"),
])
def test_an_answer_that_cannot_be_read_within_the_bound_says_why(raw: bytes, encoding: str, why: str) -> None:
    found = usage_of_encoded(raw, encoding, 1 << 20)
    assert found.usage is None and why in found.unread


def test_a_gzip_bomb_is_decoded_only_to_the_cap_and_never_held_whole() -> None:
    raw = bomb(256)
    tracemalloc.start()
    try:
        found = usage_of_encoded(raw, "gzip", 64 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert found.usage is None and "over" in found.unread
    assert peak < 8 << 20, peak
