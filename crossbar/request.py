"""Routing and body inspection for requests on the main listener (pure, no I/O).

`resolve` turns a method, request target and `X-Crossbar-Route` header into a concrete route,
upstream path and the query parameters crossbar passes on; `peek_body` reads the few fields
crossbar needs from a request body. Both raise only `CrossbarError`, and their messages never
echo body content or raw control characters. `peek_body_off_loop` runs a large body's peek in a
worker thread, parsed one piece at a time so the event loop keeps the interpreter lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import lru_cache
from itertools import repeat
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, quote

from crossbar import jsonpieces, jsonread, textjoin
from crossbar.config import RouteConf
from crossbar.errors import CrossbarError, bad_request, not_found, too_large
from crossbar.guard import DEFAULT_BYTES_PER_TOKEN
from crossbar.jsonpieces import Sink
from crossbar.jsonread import UNREAD
from crossbar.reclaim import collector_paused

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
MODEL_MAX = 256  # characters of a model name; longer or unprintable names are refused
TOKEN_ID_BYTES = int(DEFAULT_BYTES_PER_TOKEN)  # a literal token id counts as this many prompt bytes
# Bodies this large are peeked in a worker thread, a piece at a time; a smaller one is parsed on the
# loop in one call (about 1 ms per MiB here), which is quicker than the thread's hand-over...
OFF_LOOP_BYTES = 2 * 1024 * 1024
# ...unless it holds this many JSON values (a small body of tiny values, `[[],[],...]`, took 0.1 s
# to parse and 0.4 s to tally per 2 MiB): every value but the last of an array or object follows a
# comma, so a body of fewer commas holds fewer values. Bodies under COUNT_FROM are not counted.
OFF_LOOP_VALUES = 16_384
COUNT_FROM = 32 * 1024
SYSTEM_ROLES = frozenset({"system", "developer"})
_ROLE_CHARS = max(map(len, SYSTEM_ROLES))  # a longer role is not hashed (a role of 32 MiB: 17 ms)
_SHOW_MAX = 130  # longest untrusted text quoted in an error message


class Resolved(NamedTuple):
    route: RouteConf  # concrete: a template match carries the requested name
    path: str  # upstream path without query, e.g. "/v1/chat/completions"
    query: str  # what goes upstream: "" or "model=x&autoload=false" (without "?")
    model: str = ""  # the query's `model`, validated; "" when absent

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
    if ROUTE_NAME.fullmatch(name) is None:  # `valid_route_name`, without a call on every request
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


def _not_allowed(method: str, path: str) -> CrossbarError:
    return not_found(f"path not allowed: {_show_path(method)} {_show_path(path)}")


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
    if path in BARE_PATHS:
        if not header_route:
            raise not_found(NO_ROUTE)
        name, upstream = header_route, path
    elif not path.startswith("/"):
        raise _not_allowed(method, path)
    elif path.startswith("//"):  # e.g. curl ".../$ROUTE/v1/..." with the variable unset
        raise not_found(EMPTY_ROUTE)
    else:
        name, _, rest = path[1:].partition("/")
        upstream = "/" + rest
    route = match_route(name, routes)
    if route is None:
        raise not_found(f"unknown route {_show(name)}")
    if (method, upstream) not in ALLOWED:
        raise _not_allowed(method, upstream)
    if not query:  # the usual request: no query, so nothing of it goes upstream
        return Resolved(route, upstream, "")
    return _resolved(route, upstream, query)


def resolve_listener(method: str, raw_path: str, route: RouteConf) -> Resolved:
    """A request on a route's own listener: every request is that route, its path goes upstream
    unchanged. Bare `/slots` is allowed, `/slots/<id>` actions are not."""
    path, _, query = raw_path.partition("?")
    if (method, path) not in LISTENER_ALLOWED:
        raise _not_allowed(method, path)
    return _resolved(route, path, query)


def _resolved(route: RouteConf, path: str, raw_query: str) -> Resolved:
    """Only `model` passes upstream from a query (the first one, validated), always with
    `autoload=false` so that no client makes a llama-server router load a model; every other
    parameter, `autoload` included, is dropped."""
    model = next((value for name, value in parse_qsl(raw_query, keep_blank_values=True)
                  if name == "model"), "") if raw_query else ""
    if not model:
        return Resolved(route=route, path=path, query="")
    check_model(model, "query parameter 'model'")
    return Resolved(route=route, path=path, query=f"model={quote(model, safe='')}&autoload=false",
                    model=model)


def check_model(model: str, where: str = "'model'") -> None:
    """A model name is 1 to MODEL_MAX printable characters, else 400."""
    if not model or len(model) > MODEL_MAX:
        raise bad_request(f"{where} must be 1 to {MODEL_MAX} characters")
    if not model.isprintable():
        raise bad_request(f"{where} must not contain control or unprintable characters")


def is_control(method: str, path: str) -> bool:
    """A control call rides beside its own stream: it follows the lease, takes no slot, skips the
    context guard and writes no accounting row."""
    return method in ("GET", "HEAD") or path in CONTROL_POSTS


# ---------------------------------------------------------------- bodies


class BodyPeek(NamedTuple):
    model: str  # body.model, else the route's default_model, else ""
    stream: bool  # body.stream is True
    include_usage: bool  # body.stream_options.include_usage is True
    fingerprint: str  # "" when there is no user message
    prompt_bytes: int  # UTF-8 bytes of what becomes prompt tokens (see `peek_body`)
    n_messages: int


_UTF8_SLICE = 1 << 18  # characters of a large text encoded per call to count its UTF-8 bytes


def _utf8_len(text: str) -> int:
    """UTF-8 bytes of `text`; a large one is encoded a slice at a time (each call holds the
    interpreter lock: an 8M-character text in one call held it 30 ms)."""
    if text.isascii():
        return len(text)
    if len(text) <= _UTF8_SLICE:
        return len(text.encode("utf-8", "surrogatepass"))
    return sum(len(text[at:at + _UTF8_SLICE].encode("utf-8", "surrogatepass"))
               for at in range(0, len(text), _UTF8_SLICE))


_RUN_MEMBERS = 256  # members of a large array or object measured per call...
_RUN_CHARS = 1 << 16  # ...or characters of the strings among them, whichever comes first


class _Unwritable(Exception):
    """orjson cannot write the value (deeper than 254 levels, an integer beyond 64 bits, a lone
    surrogate): the standard library measures it instead."""


def _json_len(value: Any, large: Collection[int] = frozenset()) -> int:
    """UTF-8 bytes of `value` as compact JSON (how a chat template renders tools and arguments).
    An array or object whose id is in `large` (a large body's, read a member at a time) is measured
    a run of members at a time, and a string longer than _UTF8_SLICE a slice at a time: each call
    holds the interpreter lock, and one for a 23 MiB list of tools held it 70 ms. The sum is what
    one call over the whole value gives: orjson's, each piece measured at its depth in the whole,
    else (orjson cannot write some of it: a lone surrogate, an integer beyond 64 bits, nesting
    past its limit) the standard library's, whose numbers it writes differently."""
    try:
        return _measured(value, large, _orjson_len, 0)
    except _Unwritable:
        return _measured(value, large, _stdlib_len, 0)


def _orjson_len(value: Any, depth: int) -> int:
    """orjson's bytes for `value` where it stands `depth` arrays or objects deep: as deep as that
    in the whole value, so that nesting past orjson's limit fails here as it would there."""
    for _ in range(depth):
        value = [value]
    size = jsonread.compact_len(value)
    if size is None:
        raise _Unwritable
    return size - 2 * depth


def _stdlib_len(value: Any, depth: int) -> int:
    return _utf8_len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _measured(value: Any, large: Collection[int], measure: Callable[[Any, int], int], depth: int) -> int:
    """`value`'s bytes, where it stands `depth` arrays or objects deep."""
    if type(value) is str and len(value) > _UTF8_SLICE:
        return 2 + sum(measure(value[at:at + _UTF8_SLICE], depth) - 2
                       for at in range(0, len(value), _UTF8_SLICE))
    if id(value) not in large or not value or not isinstance(value, list | dict):
        return measure(value, depth)  # (an empty one too: it is measured at its depth here)
    commas = max(0, len(value) - 1)
    if isinstance(value, list):
        return 2 + commas + _members_len(value, large, measure, depth)
    colons = len(value)
    return 2 + commas + colons + _members_len(list(value), large, measure, depth) \
        + _members_len(list(value.values()), large, measure, depth)


def _members_len(members: Sequence[Any], large: Collection[int], measure: Callable[[Any, int], int],
                 depth: int) -> int:
    """The sum of the compact JSON bytes of `members`, those of an array or object `depth` deep:
    small ones a run per call (the run an array in the container's place), the others each
    measured on its own."""
    total, run, run_chars = 0, [], 0
    for member in members:
        if type(member) is str:
            if len(member) > _UTF8_SLICE:
                total += _measured(member, large, measure, depth + 1)
                continue
            run_chars += len(member)
        elif id(member) in large:
            total += _measured(member, large, measure, depth + 1)
            continue
        run.append(member)
        if len(run) >= _RUN_MEMBERS or run_chars >= _RUN_CHARS:
            total += measure(run, depth) - 1 - len(run)  # less the brackets and commas of the run
            run, run_chars = [], 0
    if run:
        total += measure(run, depth) - 1 - len(run)
    return total


def _load_object(raw: bytes, sinks: Mapping[str, Callable[[], Sink]] | None = None,
                 piecewise: bool = False, large: list[Any] | None = None) -> dict[str, Any]:
    """The body as a JSON object. NaN and ±Infinity are refused (they are not JSON). A body below
    OFF_LOOP_BYTES is read by orjson in one call (`crossbar.jsonread`); a larger one, one asked to
    be read `piecewise`, or one orjson refuses, by the standard library: piecewise, it is decoded
    and parsed a piece at a time (the same result and errors as one `json.loads`), its top-level
    arrays named in `sinks` fed to them one element at a time, its large arrays and objects added
    to `large` (`jsonpieces.loads`)."""
    piecewise = piecewise or len(raw) >= OFF_LOOP_BYTES
    obj = UNREAD if piecewise else jsonread.loads(raw)
    if isinstance(obj, dict):  # the usual body
        return obj
    if obj is UNREAD:
        obj = _load_standard(raw, piecewise, sinks, large)
    if not isinstance(obj, dict):
        only = [obj]  # a text of 32 MiB, say: freed here, not by the error's traceback on the loop
        del obj
        textjoin.discard(only)
        raise bad_request("request body must be a JSON object")
    return obj


def _load_standard(raw: bytes, piecewise: bool, sinks: Mapping[str, Callable[[], Sink]] | None,
                   large: list[Any] | None = None) -> Any:
    """The standard library's reading of the body, a piece at a time when `piecewise`; what it
    refuses is a 400 that says why. A large body's decoded text is handed back to the system here,
    in the worker (`textjoin.discard`), not left to an error that travels to the event loop."""
    try:
        text = jsonpieces.decode_utf8(raw) if piecewise else raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None  # refused outside the handler: the error's traceback holds the decoded pieces
    if text is None:
        raise bad_request("request body is not valid UTF-8")
    obj, refusal = _read_text(text, piecewise, sinks, large)
    only = [text]
    del text
    textjoin.discard(only)
    if refusal is not None:
        raise refusal
    return obj


def _read_text(text: str, piecewise: bool, sinks: Mapping[str, Callable[[], Sink]] | None,
               large: list[Any] | None) -> tuple[Any, CrossbarError | None]:
    """The body's value, or None and the error that refuses it, holding nothing of the text (a
    JSON error holds all of it, and a traceback the reader's frames)."""
    try:
        return (jsonpieces.loads(text, sinks, large) if piecewise else jsonpieces.DECODER.decode(text)), None
    except CrossbarError as e:  # a sink's refusal of a message
        e.__traceback__ = e.__context__ = e.__cause__ = None
        return None, e
    except json.JSONDecodeError as e:
        where = f"at line {e.lineno} column {e.colno}"
        return None, bad_request(f"request body is not valid JSON: {e.msg} {where}")
    except RecursionError:
        return None, bad_request("request body is not valid JSON: nested too deeply")
    except jsonpieces.ConstantRefused as e:
        return None, bad_request(f"request body is not valid JSON: {e}")
    except (jsonpieces.TooManyMembers, jsonpieces.KeyTooLong) as e:
        return None, bad_request(f"request body refused: {e}")
    except ValueError:  # an integer beyond sys.get_int_max_str_digits()
        return None, bad_request("request body is not valid JSON: a number is too long")


def _content_text_bytes(content: Any, where: str) -> int:
    """UTF-8 bytes of a message content's text (parts joined with "\\n"); validates its shape.
    Non-text parts (images, audio) count nothing: their token cost is not told by their bytes."""
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


def _tool_call_bytes(calls: Any, large: Collection[int] = frozenset()) -> int:
    """Bytes of an assistant message's tool calls (function names and arguments); `large`: see
    `_json_len`."""
    if not isinstance(calls, list):
        return 0
    total = 0
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        for value in (function.get("name"), function.get("arguments")):
            if isinstance(value, str):
                total += _utf8_len(value)
            elif value is not None:
                total += _json_len(value, large)
    return total


class _ChatTally:
    """Chat messages, in order: validated, their prompt bytes (roles, texts, tool calls) summed,
    the first system and first user text kept for the fingerprint."""

    __slots__ = ("count", "prompt_bytes", "system", "user")

    def __init__(self) -> None:
        self.count = 0
        self.prompt_bytes = 0
        self.system: bytes | None = None
        self.user: bytes | None = None

    def extend(self, messages: Sequence[Any], large: Sequence[Any] = ()) -> None:
        """The next messages: a small body's whole list, or a large body's, a batch at a time as
        it is parsed (`large`: the batch's large arrays and objects, see `_json_len`). The running
        figures stay in locals for the loop."""
        if len(messages) >= _PLAIN_BATCH and self._extend_plain(messages):
            return
        large_ids = frozenset(map(id, large)) if large else frozenset()
        prompt_bytes, system, user = self.prompt_bytes, self.system, self.user
        for index, message in enumerate(messages, self.count):
            if not isinstance(message, dict):
                raise bad_request(f"messages[{index}] must be an object")
            role = message.get("role")
            if not isinstance(role, str):
                raise bad_request(f"messages[{index}].role must be a string")
            content = message.get("content")
            if isinstance(content, str) and content.isascii() and role.isascii():  # the usual case
                prompt_bytes += len(role) + len(content)
            else:
                prompt_bytes += _utf8_len(role) + _content_text_bytes(content, f"messages[{index}]")
            if "tool_calls" in message:
                prompt_bytes += _tool_call_bytes(message["tool_calls"], large_ids)
            if user is None and role == "user":
                user = _text_prefix(content)
            elif system is None and len(role) <= _ROLE_CHARS and role in SYSTEM_ROLES:
                system = _text_prefix(content)
        self.count += len(messages)
        self.prompt_bytes, self.system, self.user = prompt_bytes, system, user

    def _extend_plain(self, messages: Sequence[Any]) -> bool:
        """`extend` for a batch of plain messages (each a dict whose role and content are ASCII
        strings, without tool calls), in passes that run in C rather than a Python loop per
        message: a large body's batches of small messages spent most of its peek here. False,
        with nothing changed, for any other batch (`extend` then reads it message by message,
        and says which one is wrong)."""
        if set(map(type, messages)) != {dict}:
            return False
        roles = list(map(dict.get, messages, repeat("role")))
        contents = list(map(dict.get, messages, repeat("content")))
        if (set(map(type, roles)) != {str} or set(map(type, contents)) != {str}
                or not all(map(str.isascii, roles)) or not all(map(str.isascii, contents))
                or max(map(len, roles)) > _ROLE_CHARS
                or any(map(dict.__contains__, messages, repeat("tool_calls")))):
            return False
        self.prompt_bytes += sum(map(len, roles)) + sum(map(len, contents))
        if self.user is None and "user" in roles:
            self.user = _text_prefix(contents[roles.index("user")])
        if self.system is None and (system_roles := SYSTEM_ROLES.intersection(roles)):
            self.system = _text_prefix(contents[min(map(roles.index, system_roles))])
        self.count += len(messages)
        return True


_PLAIN_BATCH = 32  # messages from which a batch is first tried as plain (`_ChatTally._extend_plain`)


_CHAT_SINKS: Mapping[str, Callable[[], Sink]] = {"messages": _ChatTally}


def _chat_tally(body: Mapping[str, Any], large: Sequence[Any] = ()) -> _ChatTally:
    """Everything the chat template turns into prompt tokens, apart from its own fixed text:
    the messages' roles, texts and tool calls, and the tool definitions (`large`: the body's large
    arrays and objects, see `_json_len`)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        tally = _ChatTally()
        tally.extend(messages)
    elif isinstance(messages, _ChatTally):  # a large body's messages, tallied while it was parsed
        tally = messages
    else:
        raise bad_request("'messages' must be a list")
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        tally.prompt_bytes += _json_len(tools, frozenset(map(id, large)) if large else frozenset())
    return tally


def _piece_bytes(item: Any) -> int:
    """One element of a prompt list: text, a token id, a list of either, or a multimodal prompt."""
    if isinstance(item, str):
        return _utf8_len(item)
    if isinstance(item, int) and not isinstance(item, bool):
        return TOKEN_ID_BYTES
    if isinstance(item, list):
        return sum(_utf8_len(x) if isinstance(x, str) else TOKEN_ID_BYTES
                   for x in item if isinstance(x, str | int) and not isinstance(x, bool))
    if isinstance(item, dict) and isinstance(item.get("prompt_string"), str):
        return _utf8_len(item["prompt_string"])
    return 0


class _PieceTally:
    """A prompt list's bytes, summed a batch of elements at a time as a large body is parsed (the
    elements are dropped: a list of many tiny ones never piles up for the garbage collector)."""

    __slots__ = ("prompt_bytes",)

    def __init__(self) -> None:
        self.prompt_bytes = 0

    def extend(self, items: Sequence[Any], large: Sequence[Any] = ()) -> None:
        self.prompt_bytes += sum(map(_piece_bytes, items))


_PROMPT_SINKS: Mapping[str, Mapping[str, Callable[[], Sink]]] = {
    COMPLETIONS_PATH: {"prompt": _PieceTally}, EMBEDDINGS_PATH: {"input": _PieceTally}}


def _text_or_list_bytes(body: Mapping[str, Any], key: str) -> int:
    """Bytes of a completions `prompt` / embeddings `input`: a string, or a list of strings, token
    ids and lists of them (a token id counts as TOKEN_ID_BYTES, what the blind estimate spends on
    one token)."""
    value = body.get(key)
    if isinstance(value, str):
        return _utf8_len(value)
    if isinstance(value, _PieceTally):  # a large body's list, tallied while it was parsed
        return value.prompt_bytes
    if not isinstance(value, list):
        raise bad_request(f"'{key}' must be a string or a list")
    return sum(_piece_bytes(item) for item in value)


_NO_STREAM_OPTIONS: Mapping[str, Any] = {}  # a dict, as a body's own must be; never written


def _common_fields(body: Mapping[str, Any], default_model: str) -> tuple[str, bool, bool]:
    if "model" in body:
        model = body["model"]
        if not isinstance(model, str) or not model:
            raise bad_request("'model' must be a non-empty string")
        if len(model) > MODEL_MAX or not model.isprintable():
            check_model(model)  # refuses it, saying why
    else:
        model = default_model
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean")
    options = body.get("stream_options", _NO_STREAM_OPTIONS)
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object")
    return model, stream, options.get("include_usage") is True


def peek_body(raw: bytes | None, path: str, default_model: str, max_body: int, fp_key: bytes,
              piecewise: bool = False) -> BodyPeek:
    """The fields crossbar needs from a complete request body; the fingerprint is keyed with
    `fp_key`. `prompt_bytes` counts what becomes prompt tokens: message texts and roles, tool
    calls and tool definitions for a chat; strings, and TOKEN_ID_BYTES per literal token id, for
    completions and embeddings.

    Raises `CrossbarError` (413 over `max_body`, else 400) and nothing else, for any bytes.
    Bodies of non-completion paths (GET) are not parsed: they get the route's defaults.
    `piecewise`: parsed a piece at a time (for a worker thread; see `_load_object`).
    """
    size = len(raw) if raw else 0
    if size > max_body:
        raise too_large(f"request body is {size} bytes; the limit (max_body) is {max_body} bytes")
    if not piecewise and size < OFF_LOOP_BYTES:
        return _peek(raw, path, default_model, fp_key, False, None)
    large: list[Any] = []  # the parsed body's large arrays and objects, emptied a piece at a time
    with collector_paused():
        try:
            return _peek(raw, path, default_model, fp_key, True, large)
        finally:
            jsonpieces.dismantle(large)


def _peek(raw: bytes | None, path: str, default_model: str, fp_key: bytes, piecewise: bool,
          large: list[Any] | None) -> BodyPeek:
    if raw and path == CHAT_PATH:  # the usual request, before the checks it would pass
        body = _load_object(raw, _CHAT_SINKS, piecewise, large)
        model, stream, include_usage = _common_fields(body, default_model)
        tally = _chat_tally(body, large or ())
        fp = _digest(tally.system, tally.user, fp_key)
        return BodyPeek(model, stream, include_usage, fp, tally.prompt_bytes, tally.count)
    if path not in COMPLETION_PATHS:
        return BodyPeek(default_model, False, False, "", 0, 0)
    if not raw:
        raise bad_request("request body must be a JSON object")
    body = _load_object(raw, _PROMPT_SINKS[path], piecewise, large)
    model, stream, include_usage = _common_fields(body, default_model)
    key = "prompt" if path == COMPLETIONS_PATH else "input"
    return BodyPeek(model, stream, include_usage, "", _text_or_list_bytes(body, key), 0)


def off_loop(raw: bytes) -> bool:
    """Whether peeking this body on the event loop would hold up every other stream: a large body,
    or one of many values (see OFF_LOOP_VALUES)."""
    return len(raw) >= OFF_LOOP_BYTES or (len(raw) >= COUNT_FROM and raw.count(b",") >= OFF_LOOP_VALUES)


async def peek_body_off_loop(raw: bytes | None, path: str, default_model: str, max_body: int,
                             fp_key: bytes) -> BodyPeek:
    """`peek_body`, in a worker thread and a piece at a time when the body would hold up other
    streams (`off_loop`)."""
    if raw is not None and len(raw) <= max_body and path in COMPLETION_PATHS and off_loop(raw):
        return await asyncio.to_thread(peek_body, raw, path, default_model, max_body, fp_key, True)
    return peek_body(raw, path, default_model, max_body, fp_key)


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


def fingerprint(messages: Sequence[Mapping[str, Any]], key: bytes) -> str:
    """HMAC-SHA-256, keyed with the install's secret, over the first system (or developer)
    message and the first user message.

    Each text is cut to its first 4 KiB of UTF-8 and length-prefixed, so the encoding is
    unambiguous. Later messages never change it; "" when there is no user message. Without the
    key, a fingerprint read from the admin API or the database confirms no guessed opening.
    """
    system: bytes | None = None
    user: bytes | None = None
    for message in messages:
        role = message.get("role") if isinstance(message, Mapping) else None
        if not isinstance(role, str):
            continue
        if system is None and len(role) <= _ROLE_CHARS and role in SYSTEM_ROLES:
            system = _text_prefix(message.get("content"))
        elif user is None and role == "user":
            user = _text_prefix(message.get("content"))
        if system is not None and user is not None:
            break
    return _digest(system, user, key)


_FP_DOMAIN = b"crossbar-fp-2\0"
Sha256 = type(hashlib.sha256())  # the hash object's class (hashlib names it only in its stubs)
_SHA256_BLOCK = 64
_INNER_PAD = bytes(x ^ 0x36 for x in range(256))  # HMAC's ipad, as a `bytes.translate` table
_OUTER_PAD = bytes(x ^ 0x5C for x in range(256))  # HMAC's opad


@lru_cache(maxsize=4)
def _keyed(key: bytes) -> tuple[Sha256, Sha256]:
    """HMAC-SHA-256 under `key`, as its inner SHA-256 state (after the padded key and
    the domain) and its outer one (after the padded key): copied per fingerprint, not keyed again.
    This is `hmac.new(key, _FP_DOMAIN, hashlib.sha256)` taken apart: copying and finishing two
    SHA-256 states takes about 40 % less time than copying and finishing an `hmac.HMAC`, whose
    methods run through Python and OpenSSL's HMAC context."""
    if len(key) > _SHA256_BLOCK:
        key = hashlib.sha256(key).digest()
    key = key.ljust(_SHA256_BLOCK, b"\0")
    return (hashlib.sha256(key.translate(_INNER_PAD) + _FP_DOMAIN),
            hashlib.sha256(key.translate(_OUTER_PAD)))


def _digest(system: bytes | None, user: bytes | None, key: bytes) -> str:
    if user is None:
        return ""
    system = system or b""
    keyed_inner, keyed_outer = _keyed(key)
    inner = keyed_inner.copy()
    inner.update(b"system:%d:%buser:%d:%b" % (len(system), system, len(user), user))
    outer = keyed_outer.copy()
    outer.update(inner.digest())
    return outer.hexdigest()
