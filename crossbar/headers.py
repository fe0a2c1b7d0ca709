"""Header lookups for the request path, one pass over mitmproxy's raw header fields.

A lookup through mitmproxy's `Headers` (`get`, `get_all`, `in`) goes through `Mapping.get`,
`__getitem__` and `get_all`, encoding the name and decoding each value again: about 3 µs, and every
request makes several. These read `Headers.fields` directly and answer exactly as `Headers` does.
"""

from __future__ import annotations

from mitmproxy import http


def values(headers: http.Headers, name: bytes) -> list[str]:
    """Every value of header `name` (lower-case bytes), in order: `headers.get_all(name)`."""
    return [value.decode("utf-8", "surrogateescape") for key, value in headers.fields if key.lower() == name]


def value[D](headers: http.Headers, name: bytes, default: D) -> str | D:
    """`headers.get(name, default)`: the values joined by ", ", or `default` when there are none."""
    found = values(headers, name)
    return ", ".join(found) if found else default


# `has_any` builds the list of matching names: for the few fields of a request that is quicker
# than `any()` over a generator, which stops at the first match but is resumed per field.


def has_any(headers: http.Headers, names: frozenset[bytes]) -> bool:
    """Whether any of `names` (lower-case bytes) is in `headers`: one pass, however many names."""
    return [key for key, _ in headers.fields if key.lower() in names] != []


def event_stream(headers: http.Headers) -> bool:
    """Whether the message is a server-sent event stream (its Content-Type says so)."""
    return _is_event_stream(value(headers, b"content-type", ""))


def compressed(headers: http.Headers) -> bool:
    """Whether the message's body is sent in a content coding (gzip, br, ...), not as it is: any
    coding named in its Content-Encoding fields but `identity` (or nothing, between commas)."""
    return _names_a_coding(value(headers, b"content-encoding", ""))


def event_stream_coding(headers: http.Headers) -> tuple[bool, bool]:
    """(`event_stream(headers)`, `compressed(headers)`) in one pass over the fields: an answer's
    head is looked at for both, and each alone reads every field."""
    types: list[bytes] = []
    codings: list[bytes] = []
    for key, field in headers.fields:
        name = key.lower()
        if name == b"content-type":
            types.append(field)
        elif name == b"content-encoding":
            codings.append(field)
    return _is_event_stream(_joined(types)), _names_a_coding(_joined(codings))


def _joined(fields: list[bytes]) -> str:
    return b", ".join(fields).decode("utf-8", "surrogateescape")


def _is_event_stream(content_type: str) -> bool:
    return content_type.lstrip().lower().startswith("text/event-stream")


def _names_a_coding(content_encoding: str) -> bool:
    # the usual answer has no Content-Encoding: answered without splitting (every answer asks)
    return bool(content_encoding) and any(coding.strip().lower() not in ("", "identity")
                                          for coding in content_encoding.split(","))
