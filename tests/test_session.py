"""The conversation key a client names (crossbar.session) and its route setting: table tests."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy import http

from crossbar.config import DEFAULT_SESSION_HEADERS, ConfigError, RouteConf, parse_config
from crossbar.errors import CrossbarError
from crossbar.session import (
    MAX_SESSION_ID,
    SESSION_ID,
    KeyKind,
    conversation_fp,
    key_kind,
    session_fp,
    session_id,
)

OPENCODE_ID = "ses_dd2a72854ffe7cGKfjTPW6wqgR"  # as recorded from OpenCode 1.18.33
BODY_FP = hashlib.sha256(b"a body").hexdigest()
ROUTE = RouteConf(name="r", hosts=("a",))


def headers(*pairs: tuple[str, str]) -> http.Headers:
    return http.Headers([(k.encode(), v.encode()) for k, v in pairs])


@pytest.mark.parametrize(
    ("pairs", "names", "expected"),
    [
        ((("x-session-affinity", OPENCODE_ID), ("x-session-id", OPENCODE_ID)), DEFAULT_SESSION_HEADERS,
         OPENCODE_ID),
        ((("X-Session-Id", "abc"),), DEFAULT_SESSION_HEADERS, "abc"),  # names match case-insensitively
        ((("x-session-affinity", "first"), ("x-session-id", "second")), DEFAULT_SESSION_HEADERS, "first"),
        ((("x-session-affinity", ""), ("x-session-id", "second")), DEFAULT_SESSION_HEADERS, "second"),
        ((("x-session-affinity", "  "),), DEFAULT_SESSION_HEADERS, None),  # empty is absent
        ((("x-session-id", " padded "),), DEFAULT_SESSION_HEADERS, "padded"),
        ((("x-session-id", "same"), ("x-session-id", "same")), DEFAULT_SESSION_HEADERS, "same"),
        ((), DEFAULT_SESSION_HEADERS, None),
        ((("x-session-id", "abc"),), (), None),  # turned off
        ((("x-session-id", "abc"),), ("x-opencode-session",), None),  # only the configured names
        ((("x-opencode-session", "abc"),), ("x-opencode-session",), "abc"),
        ((("x-session-id", "x" * MAX_SESSION_ID),), DEFAULT_SESSION_HEADERS, "x" * MAX_SESSION_ID),
        ((("x-session-id", "3f2c-uuid:user@host/a+b=~._"),), DEFAULT_SESSION_HEADERS,
         "3f2c-uuid:user@host/a+b=~._"),
    ],
)
def test_session_id(pairs: Sequence[tuple[str, str]], names: tuple[str, ...], expected: str | None) -> None:
    assert session_id(headers(*pairs), names) == expected


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("x" * (MAX_SESSION_ID + 1), f"{MAX_SESSION_ID + 1} characters, at most {MAX_SESSION_ID}"),
        ("x" * 100_000, f"100000 characters, at most {MAX_SESSION_ID}"),
        ("has space", "only letters, digits"),
        ("a,b", "only letters, digits"),
        ("a\tb", "only letters, digits"),
        ("<script>", "only letters, digits"),
        ("sess\u00e9", "only letters, digits"),  # latin-1, as mitmproxy decodes header bytes
        ("a;b", "only letters, digits"),
    ],
)
def test_an_invalid_session_id_is_a_400_that_never_echoes_it(value: str, problem: str) -> None:
    h = http.Headers([(b"x-session-id", value.encode("latin-1"))])
    with pytest.raises(CrossbarError) as info:
        session_id(h, DEFAULT_SESSION_HEADERS)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error"
    assert err.message.startswith("session header x-session-id: ") and problem in err.message
    assert "session_headers" in err.message  # says how to turn it off
    assert value not in err.message


def test_the_same_header_twice_with_different_values_is_a_400() -> None:
    h = headers(("x-session-id", "one"), ("x-session-id", "two"))
    with pytest.raises(CrossbarError, match="sent 2 times with different values"):
        session_id(h, DEFAULT_SESSION_HEADERS)


def test_a_later_header_is_not_validated_once_an_earlier_one_names_the_session() -> None:
    h = headers(("x-session-affinity", "good"), ("x-session-id", "bad value"))
    assert session_id(h, DEFAULT_SESSION_HEADERS) == "good"


def _session_outcome_by_get_all(h: http.Headers, names: Sequence[str]) -> str | None:
    """The documented rule, read name by name through mitmproxy's own `Headers.get_all`: the
    first name with a non-blank value; its id, or how the 400's message for it starts."""
    for name in names:
        sent = [v.strip() for v in h.get_all(name) if v.strip()]
        if not sent:
            continue
        if len(set(sent)) > 1:
            return f"session header {name}: sent {len(sent)} times with different values"
        if len(sent[0]) > MAX_SESSION_ID or not SESSION_ID.fullmatch(sent[0]):
            return f"session header {name}: "
        return sent[0]
    return None


_header_names = st.sampled_from(["x-session-id", "X-Session-Id", "x-session-affinity", "X-SESSION-AFFINITY",
                                 "x-other", "host", "content-type"])
_header_values = st.sampled_from(["", "  ", "abc", " abc ", "def", "bad id", "é", "x" * (MAX_SESSION_ID + 1)])


@settings(max_examples=300, deadline=None)
@given(fields=st.lists(st.tuples(_header_names, _header_values), max_size=6),
       names=st.lists(st.sampled_from(["x-session-affinity", "x-session-id", "x-other", "X-Session-Id"]),
                      max_size=3, unique=True).map(tuple))
def test_session_id_answers_as_a_lookup_name_by_name(fields: list[tuple[str, str]], names: tuple[str, ...],
                                                     ) -> None:
    """A request that carries none of the names is told in one pass; any other is read name by name."""
    h = headers(*fields)
    try:
        got = session_id(h, names)
    except CrossbarError as e:
        assert e.status == 400
        got = e.message
    expected = _session_outcome_by_get_all(h, names)
    if expected is not None and expected.startswith("session header "):  # an id never holds a space
        assert got is not None and got.startswith(expected)
    else:
        assert got == expected


def test_session_fp_is_a_prefixed_hash_that_never_holds_the_id() -> None:
    fp = session_fp(OPENCODE_ID)
    assert fp == "s:" + hashlib.sha256(b"crossbar-session-1:" + OPENCODE_ID.encode()).hexdigest()
    assert OPENCODE_ID not in fp and len(fp) == 66
    assert session_fp("other") != fp


@pytest.mark.parametrize(
    ("fp", "kind"),
    [(session_fp("a"), KeyKind.SESSION), (BODY_FP, KeyKind.FINGERPRINT), ("", KeyKind.ROUTE)],
)
def test_key_kind(fp: str, kind: KeyKind) -> None:
    assert key_kind(fp) == kind


def test_no_body_fingerprint_is_ever_a_session_key() -> None:
    # fingerprints are lowercase hex: they can never start with the session prefix
    assert all(key_kind(hashlib.sha256(bytes([i])).hexdigest()) == KeyKind.FINGERPRINT for i in range(256))


@pytest.mark.parametrize(
    ("route", "pairs", "body_fp", "expected"),
    [
        (ROUTE, (("x-session-id", "abc"),), BODY_FP, session_fp("abc")),
        (ROUTE, (), BODY_FP, BODY_FP),
        (ROUTE, (("x-session-id", "abc"),), "", session_fp("abc")),  # no user message: still the session
        (ROUTE, (), "", ""),
        (RouteConf(name="r", hosts=("a",), session_headers=()), (("x-session-id", "abc"),), BODY_FP, BODY_FP),
        (RouteConf(name="r", hosts=("a",), affinity="route"), (("x-session-id", "abc"),), BODY_FP, ""),
        (RouteConf(name="r", hosts=("a",), affinity="route"), (("x-session-id", "bad id"),), BODY_FP, ""),
    ],
)
def test_conversation_fp(route: RouteConf, pairs: Sequence[tuple[str, str]], body_fp: str, expected: str,
                         ) -> None:
    assert conversation_fp(route, headers(*pairs), body_fp) == expected


# ---------------------------------------------------------------- the route setting


def config(**route: object) -> dict[str, object]:
    return {"listen": "127.0.0.1:7777", "hosts": {"a": {"base_url": "http://127.0.0.1:1", "models": ["m"]}},
            "routes": {"r": {"hosts": ["a"], **route}}}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, ("x-session-affinity", "x-session-id")),
        ([], ()),
        (["X-OpenCode-Session"], ("x-opencode-session",)),
        (["x-opencode-session", "x-session-id"], ("x-opencode-session", "x-session-id")),
    ],
)
def test_session_headers_setting(value: list[str] | None, expected: tuple[str, ...]) -> None:
    cfg = parse_config(config() if value is None else config(session_headers=value))
    assert cfg.routes["r"].session_headers == expected


@pytest.mark.parametrize(
    ("route", "message"),
    [
        ({"session_headers": "x-session-id"}, "session_headers: expected array of strings, got string"),
        ({"session_headers": ["x-a", "X-A"]}, "routes.r.session_headers: a header is listed twice"),
        ({"session_headers": ["bad header"]}, "routes.r.session_headers: 'bad header' is not an HTTP header"),
        ({"session_headers": ["x" * 65]}, "is not an HTTP header name"),
        ({"session_headers": [""]}, "routes.r.session_headers: items must not be empty strings"),
        ({"session_headers": [f"x-{i}" for i in range(9)]}, "routes.r.session_headers: at most 8"),
        ({"session_headers": ["x-session-id"], "affinity": "route"},
         'routes.r.session_headers: has no effect with affinity = "route"'),
    ],
)
def test_bad_session_headers_setting(route: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(config(**route))
    assert message in str(info.value)


def test_route_affinity_keeps_the_default_setting_without_complaint() -> None:
    assert parse_config(config(affinity="route")).routes["r"].affinity == "route"
