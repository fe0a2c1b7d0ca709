"""Routing and body inspection for requests on the main listener (pure, no I/O).

`resolve` turns a method, request target and `X-Crossbar-Route` header into a concrete route
and upstream path; `peek_body` reads the few fields crossbar needs from a request body with a
single `json.loads`. Both raise only `CrossbarError`, and their messages never echo body content
or raw control characters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from crossbar.config import RouteConf
from crossbar.errors import bad_request, not_found, too_large

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"

ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        ("POST", CHAT_PATH),
        ("POST", COMPLETIONS_PATH),
        ("POST", EMBEDDINGS_PATH),
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/props"),
    }
)
COMPLETION_PATHS: frozenset[str] = frozenset({CHAT_PATH, COMPLETIONS_PATH, EMBEDDINGS_PATH})
# A route's own listener also serves clients that manage their llama-server slot themselves.
CONTROL_POSTS: frozenset[str] = frozenset({"/tokenize", "/v1/chat/completions/control"})
LISTENER_ALLOWED: frozenset[tuple[str, str]] = (
    ALLOWED
    | {("GET", "/slots")}
    | {("POST", p) for p in CONTROL_POSTS}
    | {("HEAD", p) for m, p in ALLOWED | {("GET", "/slots")} if m == "GET"}
)
BARE_PATHS: frozenset[str] = frozenset(path for _, path in ALLOWED)

ROUTE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NO_ROUTE = "no route: put the route in the path (/<route>/v1/...) or in X-Crossbar-Route"
EMPTY_ROUTE = ("no route: the path starts with an empty route name ('//'); is the variable that "
               "should fill the route in the client's base URL set?")
FINGERPRINT_BYTES = 4096
SYSTEM_ROLES = frozenset({"system", "developer"})
_SHOW_MAX = 130  # longest untrusted text quoted in an error message


@dataclass(frozen=True, slots=True)
class Resolved:
    route: RouteConf  # concrete: a template match carries the requested name
    path: str  # upstream path without query, e.g. "/v1/chat/completions"
    query: str  # "" or "model=x&y=1" (without "?")

    @property
    def upstream_path(self) -> str:
        return f"{self.path}?{self.query}" if self.query else self.path


# ---------------------------------------------------------------- routes


def _show(text: str) -> str:
    """Untrusted text for an error message: repr() (escapes control characters), bounded."""
    if len(text) > _SHOW_MAX:
        return repr(text[:_SHOW_MAX]) + "..."
    return repr(text)


def _show_path(path: str) -> str:
    """A path as typed when it is plain printable ASCII, else quoted like `_show`."""
    if path.isascii() and path.isprintable() and " " not in path and len(path) <= _SHOW_MAX:
        return path
    return _show(path)


def valid_route_name(name: str) -> bool:
    return ROUTE_NAME.fullmatch(name) is not None


_ANY = object()  # matches exactly one character
_STAR = object()  # matches zero or more characters


@lru_cache(maxsize=256)
def _glob_tokens(template: str) -> tuple[object, ...]:
    """`*` (one or more characters) becomes ANY followed by STAR; other characters are literal."""
    tokens: list[object] = []
    for ch in template:
        tokens.extend((_ANY, _STAR) if ch == "*" else (ch,))
    return tuple(tokens)


def template_matches(template: str, name: str) -> bool:
    """True if `name` matches `template`, where `*` stands for one or more characters.

    Linear-backtracking wildcard match (O(len(template) * len(name)) at worst, no regex).
    `name` is expected to be a valid route name, so any character may fill a `*`.
    """
    tokens = _glob_tokens(template)
    t = n = 0
    star = -1
    mark = 0
    while n < len(name):
        if t < len(tokens) and (tokens[t] is _ANY or tokens[t] == name[n]):
            t += 1
            n += 1
        elif t < len(tokens) and tokens[t] is _STAR:
            star, mark = t, n
            t += 1
        elif star >= 0:
            t = star + 1
            mark += 1
            n = mark
        else:
            return False
    while t < len(tokens) and tokens[t] is _STAR:
        t += 1
    return t == len(tokens)


def match_route(name: str, routes: Mapping[str, RouteConf]) -> RouteConf | None:
    """The route for `name`: an exact entry, else the most specific matching template.

    Specificity is the template's literal length (name minus `*`); ties go to config order.
    A template match is returned as a copy named `name`. Invalid names never match.
    """
    if not valid_route_name(name):
        return None
    exact = routes.get(name)
    if exact is not None:
        return exact
    best: RouteConf | None = None
    best_len = -1
    for route in routes.values():
        if not route.is_template:
            continue
        literal = len(route.name) - route.name.count("*")
        if literal > best_len and template_matches(route.name, name):
            best, best_len = route, literal
    return dataclasses.replace(best, name=name) if best is not None else None


def _route_or_404(name: str, routes: Mapping[str, RouteConf]) -> RouteConf:
    route = match_route(name, routes)
    if route is None:
        raise not_found(f"unknown route {_show(name)}")
    return route


def _check_allowed(method: str, path: str) -> None:
    if (method, path) not in ALLOWED:
        raise not_found(f"path not allowed: {_show_path(method)} {_show_path(path)}")


def resolve(
    method: str, raw_path: str, header_route: str | None, routes: Mapping[str, RouteConf]
) -> Resolved:
    """Route and upstream path for a request target, or a 404 `CrossbarError`.

    - A bare allowed path (`/v1/chat/completions`, `/health`, ...) takes its route from
      `header_route` (the `X-Crossbar-Route` header).
    - Otherwise the first path segment is the route and the rest is the upstream path; the path
      route wins and `header_route` is ignored.
    - No percent-decoding or dot-segment folding is done: `/%2e%2e/x` is an unknown route and
      `/a/../x` asks route `a` for the (disallowed) path `/../x`.
    - Only the (method, path) pairs in `ALLOWED` pass; anything else is 404 (never 405).
    """
    path, _, query = raw_path.partition("?")
    if not path.startswith("/"):
        raise not_found(f"path not allowed: {_show_path(method)} {_show_path(path)}")
    if path in BARE_PATHS:
        if not header_route:
            raise not_found(NO_ROUTE)
        route = _route_or_404(header_route, routes)
        upstream = path
    else:
        if path.startswith("//"):  # e.g. curl ".../$ROUTE/v1/..." with the variable unset
            raise not_found(EMPTY_ROUTE)
        name, _, rest = path[1:].partition("/")
        route = _route_or_404(name, routes)
        upstream = "/" + rest
    _check_allowed(method, upstream)
    return Resolved(route=route, path=upstream, query=query)


def resolve_listener(method: str, raw_path: str, route: RouteConf) -> Resolved:
    """A request on a route's own listener: every request is that route, its path goes upstream
    unchanged. Bare `/slots` is allowed, `/slots/<id>` actions are not."""
    path, _, query = raw_path.partition("?")
    if (method, path) not in LISTENER_ALLOWED:
        raise not_found(f"path not allowed: {_show_path(method)} {_show_path(path)}")
    return Resolved(route=route, path=path, query=query)


def is_control(method: str, path: str) -> bool:
    """A control call rides beside its own stream: it follows the lease, takes no slot, skips the
    context guard and writes no accounting row."""
    return method in ("GET", "HEAD") or path in CONTROL_POSTS


# ---------------------------------------------------------------- bodies


@dataclass(frozen=True, slots=True)
class BodyPeek:
    model: str  # body.model, else the route's default_model, else ""
    stream: bool  # body.stream is True
    include_usage: bool  # body.stream_options.include_usage is True
    fingerprint: str  # "" when there is no user message
    prompt_bytes: int  # UTF-8 bytes of the prompt text (roles included for chat)
    n_messages: int


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class _ConstantRefused(ValueError):
    """NaN / Infinity / -Infinity: accepted by Python's json, but not JSON."""


def _refuse_constant(name: str) -> Any:
    raise _ConstantRefused(f"{name} is not allowed")


def _load_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object. NaN and ±Infinity are refused (they are not JSON)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("request body is not valid UTF-8") from None
    try:
        obj = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        reason = f"{e.msg} at line {e.lineno} column {e.colno}"
        raise bad_request(f"request body is not valid JSON: {reason}") from None
    except RecursionError:
        raise bad_request("request body is not valid JSON: nested too deeply") from None
    except _ConstantRefused as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    except ValueError:  # an integer beyond sys.get_int_max_str_digits()
        raise bad_request("request body is not valid JSON: a number is too long") from None
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object")
    return obj


def _content_text_bytes(content: Any, where: str) -> int:
    """UTF-8 bytes of a message content's text (parts joined with "\\n"); validates its shape."""
    if content is None:
        return 0
    if isinstance(content, str):
        return _utf8_len(content)
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string, a list of parts or null")
    total = 0
    texts = 0
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise bad_request(f"{where}.content must be a string, a list of parts or null")
        if part.get("type") == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{where}.content[{j}].text must be a string")
            total += _utf8_len(text)
            texts += 1
    return total + max(texts - 1, 0)


def _chat_prompt_bytes(body: Mapping[str, Any]) -> tuple[list[Any], int]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be a list")
    total = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise bad_request(f"{where}.role must be a string")
        total += _utf8_len(role) + _content_text_bytes(message.get("content"), where)
    return messages, total


def _text_or_list_bytes(body: Mapping[str, Any], key: str) -> int:
    """Bytes of a completions `prompt` / embeddings `input`: a string, or a list (strings summed)."""
    value = body.get(key)
    if isinstance(value, str):
        return _utf8_len(value)
    if not isinstance(value, list):
        raise bad_request(f"'{key}' must be a string or a list")
    return sum(_utf8_len(item) for item in value if isinstance(item, str))


def _common_fields(body: Mapping[str, Any], default_model: str) -> tuple[str, bool, bool]:
    model = default_model
    if "model" in body:
        model = body["model"]
        if not isinstance(model, str) or not model:
            raise bad_request("'model' must be a non-empty string")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean")
    options = body.get("stream_options", {})
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object")
    return model, stream, options.get("include_usage") is True


def peek_body(raw: bytes | None, path: str, default_model: str, max_body: int) -> BodyPeek:
    """The fields crossbar needs from a complete request body (one `json.loads`).

    Raises `CrossbarError` (413 over `max_body`, else 400) and nothing else, for any bytes.
    Bodies of non-completion paths (GET) are not parsed: they get the route's defaults.
    """
    size = len(raw) if raw else 0
    if size > max_body:
        raise too_large(f"request body is {size} bytes; the limit (max_body) is {max_body} bytes")
    if path not in COMPLETION_PATHS:
        return BodyPeek(default_model, False, False, "", 0, 0)
    if not raw:
        raise bad_request("request body must be a JSON object")
    body = _load_object(raw)
    model, stream, include_usage = _common_fields(body, default_model)
    if path == CHAT_PATH:
        messages, prompt_bytes = _chat_prompt_bytes(body)
        return BodyPeek(model, stream, include_usage, fingerprint(messages), prompt_bytes, len(messages))
    key = "prompt" if path == COMPLETIONS_PATH else "input"
    return BodyPeek(model, stream, include_usage, "", _text_or_list_bytes(body, key), 0)


# ---------------------------------------------------------------- fingerprint


def _text_prefix(content: Any) -> bytes:
    """First FINGERPRINT_BYTES UTF-8 bytes of a content's text (list parts joined with "\\n")."""
    if isinstance(content, str):
        text = content[:FINGERPRINT_BYTES]  # a char is >= 1 byte, so this prefix is enough
    elif isinstance(content, list):
        pieces: list[str] = []
        length = 0
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                piece = part["text"][:FINGERPRINT_BYTES]
                pieces.append(piece)
                length += len(piece) + 1
                if length > FINGERPRINT_BYTES:
                    break
        text = "\n".join(pieces)[:FINGERPRINT_BYTES]
    else:
        text = ""
    return text.encode("utf-8", "surrogatepass")[:FINGERPRINT_BYTES]


def fingerprint(messages: Sequence[Mapping[str, Any]]) -> str:
    """SHA-256 hex over the first system (or developer) message and the first user message.

    Each text is cut to its first 4 KiB of UTF-8 and length-prefixed, so the encoding is
    unambiguous. Later messages never change it; "" when there is no user message.
    """
    system: bytes | None = None
    user: bytes | None = None
    for message in messages:
        role = message.get("role") if isinstance(message, Mapping) else None
        if not isinstance(role, str):
            continue
        if system is None and role in SYSTEM_ROLES:
            system = _text_prefix(message.get("content"))
        elif user is None and role == "user":
            user = _text_prefix(message.get("content"))
        if system is not None and user is not None:
            break
    if user is None:
        return ""
    system = system or b""
    digest = hashlib.sha256(b"crossbar-fp-1\0")
    digest.update(b"system:%d:" % len(system) + system)
    digest.update(b"user:%d:" % len(user) + user)
    return digest.hexdigest()
