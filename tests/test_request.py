from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any
from unittest import mock
from urllib.parse import quote

import pytest
from harness import within_loop_gap
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from crossbar import jsonpieces, jsonread, request
from crossbar.config import RouteConf
from crossbar.errors import CrossbarError
from crossbar.jsonread import UNREAD
from crossbar.request import (
    ALLOWED,
    COMPLETION_PATHS,
    COUNT_FROM,
    MODEL_MAX,
    OFF_LOOP_BYTES,
    BodyPeek,
    _ChatTally,
    _content_text_bytes,
    _digest,
    _tool_call_bytes,
    _utf8_len,
    check_model,
    fingerprint,
    match_route,
    off_loop,
    peek_body,
    peek_body_off_loop,
    resolve,
    resolve_listener,
    template_matches,
)

CHAT = "/v1/chat/completions"
MIB = 1024 * 1024
KEY = b"k" * 32


def _routes(*names: str) -> dict[str, RouteConf]:
    return {name: RouteConf(name=name, hosts=("alpha",), default_model=f"dm-{name}") for name in names}


ROUTES = _routes("opencode-a", "v1", "opencode-*", "opencode-*-x", "*-tmp")


# ---------------------------------------------------------------- resolve


@pytest.mark.parametrize(
    ("method", "raw_path", "header", "route", "path", "upstream"),
    [
        ("POST", "/opencode-a/v1/chat/completions", None, "opencode-a", CHAT, CHAT),
        ("POST", "/opencode-a/v1/completions", None, "opencode-a", "/v1/completions", "/v1/completions"),
        ("POST", "/opencode-a/v1/embeddings", None, "opencode-a", "/v1/embeddings", "/v1/embeddings"),
        ("GET", "/opencode-a/v1/models", None, "opencode-a", "/v1/models", "/v1/models"),
        ("GET", "/opencode-a/health", None, "opencode-a", "/health", "/health"),
        ("GET", "/opencode-a/props?model=x&y=1", None, "opencode-a", "/props",
         "/props?model=x&autoload=false"),
        ("POST", "/opencode-a/v1/chat/completions?", None, "opencode-a", CHAT, CHAT),
        # header route on a bare path
        ("POST", CHAT, "opencode-a", "opencode-a", CHAT, CHAT),
        ("GET", "/health", "opencode-a", "opencode-a", "/health", "/health"),
        ("GET", "/v1/models?x=1", "opencode-a", "opencode-a", "/v1/models", "/v1/models"),
        # the path route wins over the header
        ("POST", "/opencode-a/v1/chat/completions", "other", "opencode-a", CHAT, CHAT),
        # a route literally named "v1" is a path route when the rest is allowed
        ("GET", "/v1/health", None, "v1", "/health", "/health"),
        # templates give a concrete route carrying the requested name
        ("POST", "/opencode-proj-123/v1/chat/completions", None, "opencode-proj-123", CHAT, CHAT),
        ("POST", CHAT, "opencode-proj-123", "opencode-proj-123", CHAT, CHAT),
    ],
)
def test_resolve_ok(
    method: str, raw_path: str, header: str | None, route: str, path: str, upstream: str
) -> None:
    resolved = resolve(method, raw_path, header, ROUTES)
    assert resolved.route.name == route
    assert resolved.path == path
    assert resolved.upstream_path == upstream
    assert not resolved.route.is_template


def test_resolve_template_keeps_template_settings() -> None:
    routes = {"opencode-*": RouteConf(name="opencode-*", hosts=("a", "b"), default_model="m", queue=False)}
    resolved = resolve("POST", "/opencode-x-42/v1/chat/completions", None, routes)
    assert resolved.route == RouteConf(name="opencode-x-42", hosts=("a", "b"), default_model="m", queue=False)
    assert routes["opencode-*"].name == "opencode-*"


@pytest.mark.parametrize(
    ("method", "raw_path", "header", "message"),
    [
        ("POST", CHAT, None, "no route: put the route in the path"),
        ("POST", CHAT, "", "no route: put the route in the path"),
        ("GET", "/health", None, "no route"),
        ("POST", CHAT, "nope", "unknown route 'nope'"),
        ("POST", "/nope/v1/chat/completions", None, "unknown route 'nope'"),
        ("POST", "/opencode-a/v1/foo", None, "path not allowed: POST /v1/foo"),
        ("POST", "/opencode-a/v1/chat/completions/x", None, "path not allowed: POST /v1/chat/completions/x"),
        ("GET", "/opencode-a/v1/chat/completions", None, "path not allowed: GET /v1/chat/completions"),
        ("POST", "/opencode-a/health", None, "path not allowed: POST /health"),
        ("DELETE", "/opencode-a/v1/models", None, "path not allowed: DELETE /v1/models"),
        ("GET", CHAT, "opencode-a", "path not allowed: GET /v1/chat/completions"),
        ("GET", "/opencode-a", None, "path not allowed: GET /"),
        ("GET", "/opencode-a/", None, "path not allowed: GET /"),
        ("GET", "/opencode-a/slots", None, "path not allowed: GET /slots"),
        ("GET", "/opencode-a/metrics", None, "path not allowed: GET /metrics"),
        ("GET", "/opencode-a/_crossbar/hosts", None, "path not allowed: GET /_crossbar/hosts"),
        ("GET", "/%2e%2e/_crossbar/hosts", None, "unknown route '%2e%2e'"),
        ("GET", "/opencode-a/../_crossbar/hosts", None, "path not allowed: GET /../_crossbar/hosts"),
        ("GET", "/opencode-a/%2e%2e/health", None, "path not allowed: GET /%2e%2e/health"),
        ("GET", "/../health", None, "unknown route '..'"),
        ("GET", "/./health", None, "unknown route '.'"),
        ("POST", "//v1/chat/completions", None, "empty route name ('//'); is the variable"),
        ("POST", "", None, "path not allowed"),
        ("POST", "v1/chat/completions", "opencode-a", "path not allowed"),
        ("POST", "*", None, "path not allowed"),
        ("POST", "http://evil/v1/chat/completions", "opencode-a", "path not allowed"),
        ("GET", "/", None, "unknown route ''"),
        # a name that looks like a template is not a route name
        ("POST", "/opencode-*/v1/chat/completions", None, "unknown route 'opencode-*'"),
        ("POST", CHAT, "*", "unknown route '*'"),
        ("POST", CHAT, "tmp", "unknown route 'tmp'"),  # "*-tmp" needs more
        ("POST", "/-lead/v1/chat/completions", None, "unknown route '-lead'"),
        ("POST", "/.hidden/v1/chat/completions", None, "unknown route '.hidden'"),
    ],
)
def test_resolve_404(method: str, raw_path: str, header: str | None, message: str) -> None:
    with pytest.raises(CrossbarError) as info:
        resolve(method, raw_path, header, ROUTES)
    assert info.value.status == 404
    assert message in info.value.message


@pytest.mark.parametrize(
    "hostile",
    [
        "a\r\nX-Injected: y",
        "a\nb",
        "a\x00b",
        "a\x1b[31mred",
        "a b",
        "a/b",
        "a" * 129,
        "a" * 100_000,
        "é",
        "opencode-\u2028x",
        "opencode-é",
        "\ufeffopencode-a",
        "opencode-a\n",
        " opencode-a",
    ],
)
def test_resolve_hostile_route_names(hostile: str) -> None:
    for header, raw_path in ((hostile, CHAT), (None, f"/{hostile}/v1/chat/completions")):
        if header is None and "/" in hostile:
            continue
        with pytest.raises(CrossbarError) as info:
            resolve("POST", raw_path, header, ROUTES)
        error = info.value
        assert error.status == 404
        assert error.message.startswith("unknown route ")
        assert error.message.isprintable()
        assert not any(ch in error.message for ch in "\r\n\x00\x1b\u2028")
        assert len(error.message) < 200
        json.loads(error.body())


def test_resolve_hostile_path_not_echoed_raw() -> None:
    with pytest.raises(CrossbarError) as info:
        resolve("GET", "/opencode-a/x\r\nSet-Cookie: a=b", None, ROUTES)
    assert info.value.status == 404
    assert "\r" not in info.value.message and "\n" not in info.value.message
    with pytest.raises(CrossbarError) as info:
        resolve("GET\r\n", "/opencode-a/health", None, ROUTES)
    assert "\r" not in info.value.message


def test_allowed_tables() -> None:
    assert len(ALLOWED) == 6
    assert {path for method, path in ALLOWED if method == "POST"} == COMPLETION_PATHS


# ---------------------------------------------------------------- match_route


@pytest.mark.parametrize(
    ("names", "query", "expected_template"),
    [
        (("opencode-a", "opencode-*"), "opencode-a", "opencode-a"),
        (("opencode-*",), "opencode-a", "opencode-*"),
        (("opencode-*",), "opencode-", None),  # '*' needs at least one character
        (("opencode-*",), "opencode", None),
        (("opencode-*",), "xopencode-a", None),
        (("*",), "anything.goes_1-2", "*"),
        (("*", "opencode-*"), "opencode-a", "opencode-*"),
        (("opencode-*", "*"), "opencode-a", "opencode-*"),
        (("opencode-*", "opencode-*-x"), "opencode-foo-x", "opencode-*-x"),
        (("opencode-*-x", "opencode-*"), "opencode-foo-x", "opencode-*-x"),
        (("opencode-*-x", "opencode-*"), "opencode-foo-y", "opencode-*"),
        # ties on literal length go to config order
        (("a*", "*b"), "ab", "a*"),
        (("*b", "a*"), "ab", "*b"),
        (("a*", "*b"), "axb", "a*"),
        (("*b", "a*"), "axb", "*b"),
        (("a*b",), "ab", None),  # each '*' needs a character
        (("a*c*e",), "abcde", "a*c*e"),
        (("a*c*e",), "ace", None),
        (("a*c*e",), "abccce", "a*c*e"),
        (("*.*",), "dir.123", "*.*"),
        (("*.*",), "dir123", None),
        (("**",), "ab", "**"),
        (("**",), "a", None),
        (("*-*-*",), "x-y-z", "*-*-*"),
        (("*-*-*",), "x-y", None),
        (("opencode-*",), "opencode-a\n", None),
        (("opencode-*",), "opencode-a/b", None),
        (("x",), "", None),
    ],
)
def test_match_route(names: tuple[str, ...], query: str, expected_template: str | None) -> None:
    routes = _routes(*names)
    route = match_route(query, routes)
    if expected_template is None:
        assert route is None
        return
    assert route is not None
    assert route.name == query
    assert route.default_model == f"dm-{expected_template}"


@pytest.mark.parametrize(
    ("template", "name", "expected"),
    [
        ("a*", "a", False),
        ("a*", "ab", True),
        ("*a", "aaaa", True),
        ("*a*a*a*b", "a" * 120, False),
        ("*a*a*a*b", "a" * 120 + "b", True),
        ("abc", "abc", True),
        ("abc", "abd", False),
    ],
)
def test_template_matches(template: str, name: str, expected: bool) -> None:
    assert template_matches(template, name) is expected


# ---------------------------------------------------------------- peek_body


def _chat(**fields: Any) -> bytes:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("raw", "path", "expected"),
    [
        (_chat(), CHAT, {"model": "dm", "stream": False, "include_usage": False, "n_messages": 1}),
        (_chat(model="m1"), CHAT, {"model": "m1"}),
        (_chat(stream=True), CHAT, {"stream": True, "include_usage": False}),
        (_chat(stream=False), CHAT, {"stream": False}),
        (_chat(stream=True, stream_options={"include_usage": True}), CHAT, {"include_usage": True}),
        (_chat(stream=True, stream_options={"include_usage": False}), CHAT, {"include_usage": False}),
        (_chat(stream=True, stream_options={"include_usage": 1}), CHAT, {"include_usage": False}),
        (_chat(stream=True, stream_options={}), CHAT, {"include_usage": False}),
        (_chat(messages=[]), CHAT, {"n_messages": 0, "fingerprint": "", "prompt_bytes": 0}),
        (_chat(messages=[{"role": "user", "content": "hé"}]), CHAT, {"prompt_bytes": 4 + 3}),
        (
            _chat(messages=[{"role": "system", "content": "ab"}, {"role": "user", "content": None}]),
            CHAT,
            {"prompt_bytes": 6 + 2 + 4, "n_messages": 2},
        ),
        (
            _chat(messages=[{"role": "assistant", "tool_calls": []}]),
            CHAT,
            {"prompt_bytes": 9, "fingerprint": ""},
        ),
        (
            _chat(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "ab"},
                            {"type": "image_url", "image_url": {"url": "data:..."}},
                            {"type": "text", "text": "c"},
                        ],
                    }
                ]
            ),
            CHAT,
            {
                "prompt_bytes": 4 + len("ab\nc"),
                "fingerprint": fingerprint([{"role": "user", "content": "ab\nc"}], KEY),
            },
        ),
        (b'{"prompt": "hello"}', "/v1/completions", {"prompt_bytes": 5, "fingerprint": "", "n_messages": 0}),
        # a literal token id counts as 4 bytes, what the blind estimate spends on one token
        (b'{"prompt": ["ab", "cd", [1, 2], 3]}', "/v1/completions", {"prompt_bytes": 4 + 3 * 4}),
        (
            b'{"prompt": "x", "model": "m2", "stream": true}',
            "/v1/completions",
            {"model": "m2", "stream": True},
        ),
        (b'{"input": "hello"}', "/v1/embeddings", {"prompt_bytes": 5}),
        (b'{"input": ["a", "bb"]}', "/v1/embeddings", {"prompt_bytes": 3}),
        (b'{"input": [[1, 2]]}', "/v1/embeddings", {"prompt_bytes": 8}),
        # GET paths: the body is not parsed
        (None, "/v1/models", {"model": "dm", "stream": False, "n_messages": 0}),
        (b"not json", "/health", {"model": "dm"}),
        # duplicate keys: the last one wins, like Python's json
        (b'{"messages": [], "model": "a", "model": "b"}', CHAT, {"model": "b"}),
        # whitespace around the object is fine
        (b' \n\t{"messages": []}\r\n', CHAT, {"n_messages": 0}),
    ],
)
def test_peek_body_ok(raw: bytes | None, path: str, expected: dict[str, Any]) -> None:
    peek = peek_body(raw, path, "dm", MIB, KEY)
    for key, value in expected.items():
        assert getattr(peek, key) == value, key


def test_peek_body_default_model_empty() -> None:
    assert peek_body(_chat(), CHAT, "", MIB, KEY).model == ""


def test_peek_body_fingerprint_matches_function() -> None:
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]
    peek = peek_body(json.dumps({"messages": messages}).encode(), CHAT, "", MIB, KEY)
    assert peek == BodyPeek("", False, False, fingerprint(messages, KEY), 6 + 3 + 4 + 5, 2)


@pytest.mark.parametrize(
    ("raw", "path", "message"),
    [
        (None, CHAT, "request body must be a JSON object"),
        (b"", CHAT, "request body must be a JSON object"),
        (b"", "/v1/embeddings", "request body must be a JSON object"),
        (b"\xff\xfe{}", CHAT, "request body is not valid UTF-8"),
        (b'{"messages": [], "model": "\xc3"}', CHAT, "request body is not valid UTF-8"),
        (b'{"a": "\xed\xa0\x80"}', CHAT, "request body is not valid UTF-8"),  # encoded surrogate
        ('{"messages": []}'.encode("utf-16"), CHAT, "request body is not valid UTF-8"),
        (b"\xef\xbb\xbf{}", CHAT, "request body is not valid JSON"),  # a BOM
        (b"{", CHAT, "request body is not valid JSON: "),
        (b"{}}", CHAT, "request body is not valid JSON: "),
        (b"{'a': 1}", CHAT, "request body is not valid JSON: "),
        (b"   ", CHAT, "request body is not valid JSON: "),
        (b"[" * 100_000, CHAT, "request body is not valid JSON"),
        (b'{"a":' * 100_000, CHAT, "request body is not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, CHAT, "request body is not valid JSON"),
        (b'{"messages": [], "x": NaN}', CHAT, "request body is not valid JSON: NaN is not allowed"),
        (b'{"messages": [], "x": Infinity}', CHAT, "request body is not valid JSON: Infinity"),
        (b'{"messages": [], "x": -Infinity}', CHAT, "request body is not valid JSON: -Infinity"),
        (b'{"messages": [], "x": ' + b"9" * 5000 + b"}", CHAT, "request body is not valid JSON: a number"),
        (b"[]", CHAT, "request body must be a JSON object"),
        (b'"x"', CHAT, "request body must be a JSON object"),
        (b"null", CHAT, "request body must be a JSON object"),
        (b"1", CHAT, "request body must be a JSON object"),
        (_chat(model=""), CHAT, "'model' must be a non-empty string"),
        (_chat(model=None), CHAT, "'model' must be a non-empty string"),
        (_chat(model=3), CHAT, "'model' must be a non-empty string"),
        (_chat(model=["m"]), CHAT, "'model' must be a non-empty string"),
        (_chat(stream="true"), CHAT, "'stream' must be a boolean"),
        (_chat(stream=1), CHAT, "'stream' must be a boolean"),
        (_chat(stream=None), CHAT, "'stream' must be a boolean"),
        (_chat(stream_options=True), CHAT, "'stream_options' must be an object"),
        (_chat(stream_options=[]), CHAT, "'stream_options' must be an object"),
        (b"{}", CHAT, "'messages' must be a list"),
        (_chat(messages={"role": "user"}), CHAT, "'messages' must be a list"),
        (_chat(messages="hi"), CHAT, "'messages' must be a list"),
        (_chat(messages=[{"role": "user", "content": "a"}, "x"]), CHAT, "messages[1] must be an object"),
        (_chat(messages=[None]), CHAT, "messages[0] must be an object"),
        (_chat(messages=[{"content": "a"}]), CHAT, "messages[0].role must be a string"),
        (_chat(messages=[{"role": 1, "content": "a"}]), CHAT, "messages[0].role must be a string"),
        (
            _chat(messages=[{"role": "user", "content": 5}]),
            CHAT,
            "messages[0].content must be a string, a list of parts or null",
        ),
        (
            _chat(messages=[{"role": "user", "content": {"type": "text", "text": "a"}}]),
            CHAT,
            "messages[0].content must be a string, a list of parts or null",
        ),
        (
            _chat(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": ["a"]}]),
            CHAT,
            "messages[1].content must be a string, a list of parts or null",
        ),
        (
            _chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
            CHAT,
            "messages[0].content[0].text must be a string",
        ),
        (b"{}", "/v1/completions", "'prompt' must be a string or a list"),
        (b'{"prompt": 5}', "/v1/completions", "'prompt' must be a string or a list"),
        (b'{"prompt": null}', "/v1/completions", "'prompt' must be a string or a list"),
        (b"{}", "/v1/embeddings", "'input' must be a string or a list"),
        (b'{"input": {"a": 1}}', "/v1/embeddings", "'input' must be a string or a list"),
    ],
)
def test_peek_body_400(raw: bytes | None, path: str, message: str) -> None:
    with pytest.raises(CrossbarError) as info:
        peek_body(raw, path, "dm", MIB, KEY)
    assert info.value.status == 400
    assert info.value.message.startswith(message)


def test_peek_body_error_messages_never_echo_the_body() -> None:
    secret = "sekrit-\r\n-value"
    bad = [
        json.dumps({"messages": [{"role": "user", "content": 5}], "x": secret}).encode(),
        json.dumps({"model": 5, "x": secret}).encode(),
        b'{"x": "' + secret.encode()[:7] + b"\xff",
        b'{"sekrit": ',
        b"sekrit",
    ]
    for raw in bad:
        with pytest.raises(CrossbarError) as info:
            peek_body(raw, CHAT, "", MIB, KEY)
        assert "sekrit" not in info.value.message
        assert "\n" not in info.value.message


@pytest.mark.parametrize(
    ("size", "limit", "status"),
    [(100, 99, 413), (100, 100, 400), (MIB + 1, MIB, 413)],
)
def test_peek_body_size(size: int, limit: int, status: int) -> None:
    raw = b"x" * size
    with pytest.raises(CrossbarError) as info:
        peek_body(raw, CHAT, "", limit, KEY)
    assert info.value.status == status
    if status == 413:
        assert info.value.message == (f"request body is {size} bytes; the limit (max_body) is {limit} bytes")


def test_peek_body_size_applies_to_get_paths_too() -> None:
    with pytest.raises(CrossbarError) as info:
        peek_body(b"x" * 10, "/v1/models", "", 5, KEY)
    assert info.value.status == 413


# ---------------------------------------------------------------- fingerprint


def _fp(*messages: tuple[str, Any]) -> str:
    return fingerprint([{"role": role, "content": content} for role, content in messages], KEY)


def test_fingerprint_stable_across_turns() -> None:
    first = [("system", "You are terse."), ("user", "Write a poem.")]
    turns = [
        first,
        [*first, ("assistant", "Roses...")],
        [*first, ("assistant", "Roses..."), ("user", "Another."), ("assistant", "Violets...")],
        [*first, ("assistant", None), ("tool", "42"), ("user", "More"), ("system", "late system")],
    ]
    fps = {_fp(*turn) for turn in turns}
    assert len(fps) == 1
    (fp,) = fps
    assert len(fp) == 64 and int(fp, 16) >= 0


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ((("user", "hello"),), (("user", "hello!"),), False),
        ((("system", "s"), ("user", "u")), (("system", "s2"), ("user", "u")), False),
        ((("system", "s"), ("user", "u")), (("developer", "s"), ("user", "u")), True),
        ((("system", "s"), ("user", "u")), (("user", "u"), ("system", "s")), True),
        ((("system", "s"), ("user", "u")), (("user", "u"),), False),
        ((("user", "u"),), (("system", ""), ("user", "u")), True),
        # no ambiguity between where system ends and user begins
        ((("system", "a"), ("user", "bc")), (("system", "ab"), ("user", "c")), False),
        ((("system", "a\0user\0b"), ("user", "c")), (("system", "a"), ("user", "b\0user\0c")), False),
        ((("system", "u"),), (("user", "u"),), False),
        # only the first 4 KiB of each text matters
        ((("user", "x" * 4096 + "A"),), (("user", "x" * 4096 + "B"),), True),
        ((("user", "x" * 4095 + "A"),), (("user", "x" * 4095 + "B"),), False),
        ((("system", "s" * 5000 + "1"), ("user", "u")), (("system", "s" * 5000 + "2"), ("user", "u")), True),
        # multi-byte characters count in bytes: 2048 x "é" is exactly 4096 bytes
        ((("user", "é" * 2048 + "A"),), (("user", "é" * 2048 + "B"),), True),
        ((("user", "é" * 2047 + "A"),), (("user", "é" * 2047 + "B"),), False),
        # list of parts hashes as its text parts joined with "\n"
        (
            (("user", [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]),),
            (("user", "ab\ncd"),),
            True,
        ),
        (
            (("user", [{"type": "text", "text": "ab"}, {"type": "image_url", "image_url": {"url": "x"}}]),),
            (("user", "ab"),),
            True,
        ),
        (
            (("user", [{"type": "text", "text": "x" * 3000}, {"type": "text", "text": "y" * 3000 + "A"}]),),
            (("user", "x" * 3000 + "\n" + "y" * 3000 + "B"),),
            True,
        ),
        ((("user", None),), (("user", ""),), True),
        ((("user", None),), (("user", []),), True),
    ],
)
def test_fingerprint_table(
    a: tuple[tuple[str, Any], ...], b: tuple[tuple[str, Any], ...], same: bool
) -> None:
    assert (_fp(*a) == _fp(*b)) is same


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "system", "content": "s"}],
        [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}],
        [{"content": "no role"}],
        ["not a mapping", 3, None],
    ],
)
def test_fingerprint_no_user(messages: list[Any]) -> None:
    assert fingerprint(messages, KEY) == ""


def test_fingerprint_tolerates_odd_shapes() -> None:
    odd = [
        {"role": ["x"]},
        {"role": "user", "content": [1, {"type": "text", "text": 2}, {"text": "no type"}]},
    ]
    assert fingerprint(odd, KEY) == _fp(("user", ""))


# ---------------------------------------------------------------- properties

_json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
_json_values = st.recursive(
    _json_scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)
_message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | _json_values,
        "content": st.text(max_size=30)
        | st.none()
        | st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | _json_values})
            | st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10) | _json_values})
            | _json_values,
            max_size=4,
        )
        | _json_values,
    },
)
_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.text(max_size=10) | _json_values,
        "stream": st.booleans() | _json_values,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": _json_values}) | _json_values,
        "messages": st.lists(_message | _json_values, max_size=5) | _json_values,
        "prompt": _json_values,
        "input": _json_values,
    },
)
_paths = st.sampled_from([*sorted(COMPLETION_PATHS), "/v1/models", "/health"])


def _peek_or_crossbar_error(raw: bytes, path: str) -> None:
    try:
        peek = peek_body(raw, path, "dm", 4096, KEY)
    except CrossbarError as e:
        assert e.status in (400, 413)
        assert "\n" not in e.message
        return
    assert isinstance(peek, BodyPeek)
    assert peek.prompt_bytes >= 0


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=300), path=_paths)
def test_peek_body_arbitrary_bytes(raw: bytes, path: str) -> None:
    _peek_or_crossbar_error(raw, path)


@settings(max_examples=300, deadline=None)
@given(value=_json_values, path=_paths)
def test_peek_body_arbitrary_json(value: Any, path: str) -> None:
    _peek_or_crossbar_error(json.dumps(value).encode(), path)


@settings(max_examples=300, deadline=None)
@given(value=_bodies, path=_paths)
def test_peek_body_body_shaped_json(value: dict[str, Any], path: str) -> None:
    _peek_or_crossbar_error(json.dumps(value).encode(), path)


@settings(max_examples=200, deadline=None)
@given(method=st.text(max_size=8), raw_path=st.text(max_size=60), header=st.none() | st.text(max_size=40))
def test_resolve_arbitrary_input(method: str, raw_path: str, header: str | None) -> None:
    try:
        resolved = resolve(method, raw_path, header, ROUTES)
    except CrossbarError as e:
        assert e.status == 404
        assert e.message.isprintable()
        return
    assert (method, resolved.path) in ALLOWED
    assert not resolved.route.is_template


# ---------------------------------------------------------------- query strings, model names


@pytest.mark.parametrize(
    ("raw_path", "query", "model"),
    [
        ("/opencode-a/props?model=m&autoload=true", "model=m&autoload=false", "m"),
        ("/opencode-a/props?autoload=true", "", ""),
        ("/opencode-a/slots?fail_on_no_slot=1&model=a%2Fb&model=c", "model=a%2Fb&autoload=false", "a/b"),
        ("/opencode-a/health?x=1&y", "", ""),
        ("/opencode-a/v1/chat/completions?autoload=1", "", ""),
    ],
)
def test_only_model_passes_in_a_query(raw_path: str, query: str, model: str) -> None:
    method = "POST" if "completions" in raw_path else "GET"
    if raw_path.startswith("/opencode-a/slots"):
        resolved = resolve_listener("GET", raw_path.removeprefix("/opencode-a"), ROUTES["opencode-a"])
    else:
        resolved = resolve(method, raw_path, None, ROUTES)
    assert (resolved.query, resolved.model) == (query, model)


@pytest.mark.parametrize("model", ["x" * (MODEL_MAX + 1), "a\x1b[2Jb", "a\nb", "\u2028"])
def test_bad_model_names_are_400(model: str) -> None:
    with pytest.raises(CrossbarError) as exc:
        peek_body(json.dumps({"model": model, "messages": []}).encode(), CHAT, "", MIB, KEY)
    assert exc.value.status == 400
    with pytest.raises(CrossbarError) as exc:
        resolve("GET", "/opencode-a/props?model=" + quote(model), None, ROUTES)
    assert exc.value.status == 400


def test_longest_model_name_passes() -> None:
    name = "m" * MODEL_MAX
    assert peek_body(json.dumps({"model": name, "messages": []}).encode(), CHAT, "", MIB, KEY).model == name


def _model_outcome(model: Any) -> str:
    """A body's `model` as the general checks judge it: the name, or the 400's message."""
    if not isinstance(model, str) or not model:
        return "'model' must be a non-empty string"
    try:
        check_model(model)
    except CrossbarError as e:
        return e.message
    return model


@settings(max_examples=300, deadline=None)
@given(model=st.text(max_size=12) | _json_values
       | st.sampled_from([c * n for c in ("m", "\x00") for n in (MODEL_MAX, MODEL_MAX + 1)]))
def test_a_body_model_is_judged_as_by_the_general_checks(model: Any) -> None:
    """The usual name passes one combined test; any other gets the message the general checks give."""
    assume("NaN" not in json.dumps(model) and "Infinity" not in json.dumps(model))
    try:
        got = peek_body(json.dumps({"model": model, "messages": []}).encode(), CHAT, "", MIB, KEY).model
    except CrossbarError as e:
        assert e.status == 400
        got = e.message
    assert got == _model_outcome(model)


# ---------------------------------------------------------------- prompt size: what becomes tokens


def test_tools_and_tool_calls_count_toward_the_prompt() -> None:
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    call = {"id": "1", "type": "function", "function": {"name": "read", "arguments": '{"p":"a"}'}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]}]
    plain = peek_body(json.dumps({"messages": messages[:1]}).encode(), CHAT, "", MIB, KEY).prompt_bytes
    with_call = peek_body(json.dumps({"messages": messages}).encode(), CHAT, "", MIB, KEY).prompt_bytes
    with_tools = peek_body(json.dumps({"messages": messages, "tools": tools}).encode(), CHAT, "", MIB,
                           KEY).prompt_bytes
    assert with_call == plain + len("assistant") + len("read") + len('{"p":"a"}')
    assert with_tools == with_call + len(json.dumps(tools, separators=(",", ":")))


_texts = st.text(max_size=20) | st.sampled_from(["", "é", "日本語", "\ud800", "\U0001f600", "x" * 5000])
# no integers beyond 64 bits: orjson reads them as floats, which count otherwise (see jsonread)
_tool_arguments = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.dictionaries(
    st.text(max_size=5), _texts, max_size=3)
_tallied_messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | _texts,
     "content": _texts | st.none() | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _texts})
                                              | st.fixed_dictionaries({"type": st.just("image_url")}))},
    optional={"tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries(
        {}, optional={"name": _texts, "arguments": _texts | _tool_arguments})})) | _json_values}),
    max_size=6)


@settings(max_examples=400, deadline=None)
@given(messages=_tallied_messages)
def test_a_chat_tallies_as_its_messages_one_at_a_time(messages: list[dict[str, Any]]) -> None:
    """The message loop (with its shortcut for ASCII text) sums what the per-part counts give, and
    keeps the openings `fingerprint` finds; a large body's messages, fed one at a time as it is
    parsed, tally the same."""
    assume("NaN" not in json.dumps(messages) and "Infinity" not in json.dumps(messages))
    expected = BodyPeek("", False, False, fingerprint(messages, KEY), sum(
        _utf8_len(m["role"]) + _content_text_bytes(m["content"], "") + _tool_call_bytes(m.get("tool_calls"))
        for m in messages), len(messages))
    raw = json.dumps({"messages": messages}).encode()  # a lone surrogate is escaped: valid UTF-8
    assert peek_body(raw, CHAT, "", MIB, KEY) == expected
    with mock.patch("crossbar.request.OFF_LOOP_BYTES", 0):  # parsed a piece at a time
        assert peek_body(raw, CHAT, "", MIB, KEY) == expected


def test_token_arrays_count_toward_the_prompt() -> None:
    raw = json.dumps({"input": ["x" * 256, [0] * 30000]}).encode()
    assert peek_body(raw, "/v1/embeddings", "", MIB, KEY).prompt_bytes == 256 + 4 * 30000


# ---------------------------------------------------------------- large bodies, a piece at a time


@settings(max_examples=300, deadline=None)
@given(value=_bodies)
def test_piecewise_parse_equals_json_loads(value: dict[str, Any]) -> None:
    assume("Infinity" not in json.dumps(value) and "NaN" not in json.dumps(value))
    for text in (json.dumps(value), json.dumps(value, indent=1)):
        assert jsonpieces.loads(text) == json.loads(text)


@pytest.mark.parametrize("text", ['{"a": [1, 2,]}', '{"a" 1}', '{"a": 1,}', '{"a": 1} x', '{"a": [1 2]}',
                                  '{"a": NaN}', '[1, 2', "", '{"a": [', '{"a": "x', "{'a': 1}"])
def test_piecewise_parse_refuses_what_json_loads_refuses(text: str) -> None:
    big = text + " " * OFF_LOOP_BYTES  # large enough to be parsed a piece at a time
    with pytest.raises(CrossbarError) as exc:
        peek_body(big.encode(), CHAT, "", 4 * MIB, KEY)
    assert exc.value.status == 400


@pytest.mark.parametrize("after", [', {"role": "user", "content": "x"}] x', ", 1", "]", ", {]"])
def test_a_large_bodys_bad_message_is_told_before_what_is_wrong_after_it(after: str) -> None:
    """A large body's messages are tallied a batch at a time as it is parsed; a message refused
    is still what the client hears about, before any fault in the text after it."""
    good = ", ".join('{"role": "user", "content": "x"}' for _ in range(3))
    raw = ('{"messages": [' + good + ', {"role": 5, "content": "x"}' + after + "}").encode()
    with mock.patch("crossbar.request.OFF_LOOP_BYTES", 0), pytest.raises(CrossbarError) as exc:
        peek_body(raw, CHAT, "", MIB, KEY)
    assert (exc.value.status, exc.value.message) == (400, "messages[3].role must be a string")


def test_large_body_peeks_like_a_small_one() -> None:
    messages = [{"role": "system", "content": "s"}]
    messages += [{"role": "user", "content": f"é {i}"} for i in range(70_000)]
    raw = json.dumps({"model": "m", "messages": messages, "stream": True}).encode()
    assert len(raw) > OFF_LOOP_BYTES
    peek = peek_body(raw, CHAT, "", 4 * MIB, KEY)
    assert peek.n_messages == 70_001 and peek.stream and peek.model == "m"
    assert peek.fingerprint == fingerprint(messages, KEY)
    assert peek.prompt_bytes == sum(len(m["role"]) + len(m["content"].encode()) for m in messages)


def test_fingerprint_is_keyed() -> None:
    messages = [{"role": "user", "content": "hello"}]
    assert fingerprint(messages, KEY) != fingerprint(messages, b"other" * 8)
    assert fingerprint(messages, KEY) == fingerprint(messages, b"k" * 32)


# ---------------------------------------------------------------- orjson and the standard library


def _peek_outcome(raw: bytes, path: str) -> BodyPeek | tuple[int, str]:
    try:
        return peek_body(raw, path, "dm", 4 * MIB, KEY)
    except CrossbarError as e:
        return e.status, e.message


def _standard_outcome(raw: bytes, path: str) -> BodyPeek | tuple[int, str]:
    """The peek as the standard library alone reads the body (what crossbar did before orjson)."""
    with mock.patch.object(jsonread, "loads", lambda text: UNREAD), \
            mock.patch.object(jsonread, "compact_len", lambda value: None):
        return _peek_outcome(raw, path)


# no floats (their shortest forms differ: 1e-07 / 1e-7) and no integers beyond 64 bits (orjson
# reads them as floats): both only change the byte count of tools, by a byte or two
_exact_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20)
_exact_values = st.recursive(
    _exact_scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)
_exact_message = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "user", "assistant", "tool"]) | _exact_values,
    "content": st.text(max_size=30) | st.none() | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"])},
        optional={"text": st.text(max_size=10) | _exact_values})),
    "tool_calls": st.lists(st.fixed_dictionaries({}, optional={"function": st.fixed_dictionaries(
        {}, optional={"name": _exact_values, "arguments": _exact_values})})) | _exact_values,
})
_exact_bodies = st.fixed_dictionaries({}, optional={
    "model": st.text(max_size=10) | _exact_values,
    "stream": st.booleans() | _exact_values,
    "messages": st.lists(_exact_message | _exact_values, max_size=5) | _exact_values,
    "tools": st.lists(_exact_values, max_size=3) | _exact_values,
    "prompt": _exact_values,
    "input": _exact_values,
})


@settings(max_examples=400, deadline=None)
@given(value=_exact_bodies, path=_paths, ascii_only=st.booleans())
def test_orjson_peeks_as_the_standard_library(value: dict[str, Any], path: str, ascii_only: bool) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    assert _peek_outcome(raw, path) == _standard_outcome(raw, path)


def _containers(value: Any) -> list[Any]:
    found, todo = [], [value]
    while todo:
        item = todo.pop()
        if isinstance(item, list | dict):
            found.append(item)
            todo += item.values() if isinstance(item, dict) else item
    return found


_measured_values = st.recursive(
    _json_scalars | st.sampled_from(["\ud800", "é" * 9, "\U0001F600" * 5, '"\\\x01' * 3, "x" * 12]),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=6), children,
                                                                      max_size=5),
    max_leaves=40)


@settings(max_examples=500, deadline=None)
@given(value=_measured_values, data=st.data())
def test_a_value_measured_a_piece_at_a_time_measures_as_it_does_whole(value: Any,
                                                                      data: st.DataObject) -> None:
    """A large body's arrays and objects are measured a run of members at a time and its long
    strings a slice at a time: the same bytes as one call over the whole value (orjson's, or the
    standard library's when orjson cannot write some of it: a lone surrogate, a large integer)."""
    whole = request._json_len(value)
    ids = [id(c) for c in _containers(value)]
    large = frozenset(data.draw(st.sets(st.sampled_from(ids)))) if ids else frozenset()
    with mock.patch.multiple(request, _UTF8_SLICE=3, _RUN_MEMBERS=2, _RUN_CHARS=4):
        assert request._json_len(value, large) == whole


def _nest(depth: int, inner: Any) -> Any:
    for _ in range(depth):
        inner = [inner]
    return inner


@pytest.mark.parametrize("depth", [252, 253, 254, 255, 256])
@pytest.mark.parametrize("deepest", [1e-05, [], {}])  # an empty one in `large`: read a member at a time
def test_a_value_nested_near_orjsons_limit_measures_in_pieces_as_it_does_whole(depth: int,
                                                                               deepest: Any) -> None:
    """Past orjson's nesting limit the whole value is the standard library's (which writes 1e-05
    where orjson writes 1e-5): a piece measured at its own depth fitted orjson, and the sum was
    orjson's."""
    value = [1e-05, _nest(depth, deepest), "x" * 5, [1, 2]]
    ids = frozenset(map(id, _containers(value)))
    with mock.patch.multiple(request, _UTF8_SLICE=3, _RUN_MEMBERS=2, _RUN_CHARS=4):
        assert request._json_len(value, ids) == request._json_len(value, frozenset())
    assert request._json_len(value, ids) == request._json_len(value)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200), path=_paths)
def test_orjson_refuses_bytes_as_the_standard_library(raw: bytes, path: str) -> None:
    assert _peek_outcome(raw, path) == _standard_outcome(raw, path)


@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "\\ud800 lone"}]}',  # orjson refuses lone surrogates
    b'{"messages": [{"role": "user", "content": "x"}], "n": ' + b"9" * 400 + b"}",  # beyond a double
    b'{"messages": [], "n": ' + b"9" * 5000 + b"}",  # beyond Python's digit limit: refused by both
    b'{"messages": [], "deep": ' + b"[" * 1024 + b"]" * 1024 + b"}",
    b'{"messages": [], "deep": ' + b"[" * 1100 + b"]" * 1100 + b"}",
    b'{"messages": [], "x": NaN}', b'{"messages": [], "x": -Infinity}',
    b'\xef\xbb\xbf{"messages": []}', b'{"messages": [], "x": "\xff"}', b'{"messages": []} x',
    b'{"messages": [{"role": "user", "content": "a"}], "messages": [{"role": "user", "content": "b"}]}',
    b'{"messages": [], "tools": [' + b"[" * 300 + b"]" * 300 + b"]}",  # orjson writes 254 levels at most
    b' \t\r\n{"messages": [{"role": "user", "content": "\\u0000\\n\\"\\\\"}]} \n',
])
def test_orjson_edge_cases_read_as_the_standard_library(raw: bytes) -> None:
    assert _peek_outcome(raw, CHAT) == _standard_outcome(raw, CHAT)


def test_numbers_orjson_writes_otherwise_change_only_the_byte_count() -> None:
    tools = [{"big": 2**70, "small": 1e-7, "huge": 1e300}]
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}).encode()
    fast, standard = _peek_outcome(raw, CHAT), _standard_outcome(raw, CHAT)
    assert isinstance(fast, BodyPeek) and isinstance(standard, BodyPeek)
    assert fast._replace(prompt_bytes=0) == standard._replace(prompt_bytes=0)
    assert abs(fast.prompt_bytes - standard.prompt_bytes) <= 6


@settings(max_examples=300, deadline=None)
@given(key=st.binary(max_size=20) | st.binary(min_size=60, max_size=200),
       system=st.none() | st.binary(max_size=100), user=st.binary(max_size=100))
def test_a_digest_is_the_hmac_of_the_standard_library(key: bytes, system: bytes | None, user: bytes) -> None:
    """Keys shorter and longer than SHA-256's 64-byte block, each from its kept keyed states."""
    expected = hmac.new(key, b"crossbar-fp-2\0", hashlib.sha256)
    expected.update(b"system:%d:" % len(system or b"") + (system or b""))
    expected.update(b"user:%d:" % len(user) + user)
    assert _digest(system, user, key) == _digest(system, user, key) == expected.hexdigest()
    assert _digest(system, None, key) == ""


@pytest.mark.parametrize("key", [KEY, b"another install's secret", b""])
def test_a_fingerprint_is_the_documented_hmac_under_each_key(key: bytes) -> None:
    system, user = "You are terse.", "héllo"
    for _ in range(2):  # the second time from the kept keyed state
        expected = hmac.new(key, b"crossbar-fp-2\0", hashlib.sha256)
        expected.update(b"system:%d:" % len(system.encode()) + system.encode())
        expected.update(b"user:%d:" % len(user.encode()) + user.encode())
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        assert fingerprint(messages, key) == expected.hexdigest()


def tiny_values_body(size: int) -> bytes:
    """A completion whose prompt is a list of empty token lists, `size` bytes long."""
    prefix, suffix = b'{"model":"m","prompt":[', b"[]]}"
    return prefix + b"[]," * ((size - len(prefix) - len(suffix)) // 3) + suffix


def test_a_small_body_of_many_values_is_peeked_off_the_loop_and_a_piece_at_a_time() -> None:
    """Under 2 MiB a body was parsed on the event loop by size alone: one of 700k tiny values held
    it 0.3-0.5 s. The values are told by the commas; such a body goes to the piecewise reading."""
    many = tiny_values_body(OFF_LOOP_BYTES - 1)
    assert off_loop(many)
    assert not off_loop(b"[]," * (COUNT_FROM // 3 - 1))  # a small body is not counted
    prose = json.dumps({"messages": [{"role": "user", "content": "words, " * 10_000}]}).encode()
    assert not off_loop(prose)  # 10,000 commas inside a text: parsed on the loop, as before
    with mock.patch("crossbar.jsonread.loads", side_effect=AssertionError("parsed in one call")):
        peek = peek_body(many, "/v1/completions", "m", 32 << 20, b"k" * 32, piecewise=True)
    assert peek.model == "m" and peek.prompt_bytes == 0  # empty token lists


async def test_peeking_a_small_body_of_many_values_does_not_hold_the_event_loop() -> None:
    # it was 300-500 ms
    peek = await within_loop_gap(lambda: peek_body_off_loop(
        tiny_values_body(OFF_LOOP_BYTES - 1), "/v1/completions", "m", 32 << 20, b"k" * 32), 0.1)
    assert peek.model == "m"


@pytest.mark.parametrize("bulk", ["content parts", "token ids", "escaped text"])
async def test_peeking_a_body_whose_bulk_is_one_value_does_not_hold_the_event_loop(bulk: str) -> None:
    """Each message (or prompt) was parsed in one C call, holding the interpreter lock for as long
    as it took: one message of 600k content parts held every stream 0.2 s."""
    path, body = {
        "content parts": (CHAT, {"messages": [
            {"role": "user", "content": [{"type": "text", "text": "t"}] * 600_000}]}),
        "token ids": ("/v1/completions", {"prompt": [[7] * 6_000_000]}),
        "escaped text": (CHAT, {"messages": [{"role": "user", "content": "ab\n" * 7_000_000}]}),
    }[bulk]
    raw = json.dumps(body).encode()
    peek = await within_loop_gap(lambda: peek_body_off_loop(raw, path, "m", 32 << 20, KEY), 0.05)
    assert peek.model == "m"


_roles = (st.sampled_from(["user", "assistant", "system", "developer", "tool", "usér"])
          | st.none() | st.just(7))
_contents = (st.sampled_from(["", "hi", "a, b", "é", "x" * 300]) | st.none()
             | st.just([{"type": "text", "text": "part"}]) | st.just(3))
_messages = st.one_of(
    st.builds(lambda r, c: {"role": r, "content": c}, _roles, _contents),
    st.builds(lambda r: {"role": r, "content": "ok",
                         "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}, _roles),
    st.builds(lambda: {"content": "no role"}), st.just("not an object"), st.just(["a list"]))
_plain = st.builds(lambda r, c: {"role": r, "content": c},
                   st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
                   st.sampled_from(["", "hi", "a, b", "x" * 300]))
_near_plain = st.sampled_from([  # one thing off a plain message
    {"role": "user", "content": "é"}, {"role": "usér", "content": "x"}, {"role": "user", "content": None},
    {"role": "user", "content": ["part"]}, {"role": 7, "content": "x"}, {"content": "x"}, "text",
    {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}])


def _tally(batches: list[list[Any]]) -> Any:
    tally = _ChatTally()
    try:
        for batch in batches:
            tally.extend(batch)
    except CrossbarError as e:
        return "refused", e.message
    return tally.count, tally.prompt_bytes, tally.system, tally.user


@settings(max_examples=300, deadline=None)
@given(messages=st.lists(_plain, min_size=30, max_size=120) | st.lists(_messages | _plain, max_size=120),
       cuts=st.lists(st.integers(1, 120), max_size=3), odd=st.integers(0, 130), data=st.data())
def test_a_batch_of_plain_messages_is_tallied_as_one_message_at_a_time_tallies_it(
        messages: list[Any], cuts: list[int], odd: int, data: Any) -> None:
    """Large batches of plain messages (ASCII role and content strings, no tool calls) are tallied
    in passes that run in C; any other batch, and what is refused, stay the per-message loop's."""
    if messages and odd < len(messages):
        messages[odd] = data.draw(_near_plain | _messages | _plain)
    batches, at = [], 0
    for cut in sorted(cuts):
        batches.append(messages[at:cut])
        at = max(at, cut)
    batches.append(messages[at:])
    with mock.patch("crossbar.request._PLAIN_BATCH", 10 ** 9):
        expected = _tally(batches)
    assert _tally(batches) == expected


@pytest.mark.parametrize("odd", [
    {"role": "user", "content": "é"}, {"role": "usér", "content": "x"}, {"role": "user", "content": None},
    {"role": "user", "content": [{"type": "text", "text": "part"}]}, {"role": 7, "content": "x"},
    {"content": "x"}, "text", {"role": "system", "content": "x", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}, {"role": "developer", "content": "late system"}])
@pytest.mark.parametrize("where", [0, 20, 39])
def test_one_message_off_plain_in_a_large_batch_is_tallied_as_the_loop_does(odd: Any, where: int) -> None:
    batch: list[Any] = [{"role": ("assistant", "user", "tool")[i % 3], "content": f"m{i}"} for i in range(40)]
    batch[where] = odd
    with mock.patch("crossbar.request._PLAIN_BATCH", 10 ** 9):
        expected = _tally([batch])
    assert _tally([batch]) == expected
    assert _tally([batch[:where], batch[where:]]) == expected  # however the batches are cut
