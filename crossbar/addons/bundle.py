"""The addons registered with mitmproxy as one addon.

mitmproxy pays for every registered addon on every event, whether or not it handles it: a walk of
the addon tree, a lookup of the hook by name, and the hook's arguments built again for each handler.
Under load, mitmproxy's hook dispatch took about a fifth of the proxy's CPU, much of it for
crossbar's ten addons. `Bundle` keeps the addons as they are (each owns one concern and is tested
alone) and gives mitmproxy one object whose hooks call the addons' handlers in their order, found
once when it is built.

What mitmproxy promises for addons holds for the bundle: handlers run in order, an async handler is
awaited before the next one starts, and an exception ends the event for the handlers after it
(mitmproxy logs it), exactly as it did when the addons were registered one by one under a script.
One difference remains, which crossbar's parts never meet: a plain function that returns an
awaitable is awaited only in a hook that also has a coroutine handler (mitmproxy awaits it
whenever the event itself is asynchronous).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from mitmproxy import addonmanager, hooks  # noqa: F401  (defines the load, running, ... hooks)
from mitmproxy.proxy import layers, server_hooks  # noqa: F401  (defines the proxy's hooks)

Handler = Callable[..., Any]


class Bundle:
    """One mitmproxy addon that runs `parts`' hook handlers in the order `parts` lists them."""

    def __init__(self, parts: Sequence[object]) -> None:
        self.parts = tuple(parts)
        for name in hooks.all_hooks:
            handlers = [h for h in (getattr(part, name, None) for part in self.parts) if callable(h)]
            if handlers:
                setattr(self, name, _dispatcher(handlers))

    def __repr__(self) -> str:
        return f"Bundle({', '.join(type(part).__name__ for part in self.parts)})"


def _dispatcher(handlers: list[Handler]) -> Handler:
    if len(handlers) == 1:
        return handlers[0]
    if any(inspect.iscoroutinefunction(h) for h in handlers):
        return _run_async(tuple(handlers))
    return _run_sync(tuple(handlers))


def _run_sync(handlers: tuple[Handler, ...]) -> Handler:
    def hook(*args: Any) -> None:
        for handler in handlers:
            handler(*args)

    return hook


def _run_async(handlers: tuple[Handler, ...]) -> Callable[..., Awaitable[None]]:
    # a coroutine function's result is awaited as it is; any other handler's only when it
    # returned an awaitable (mitmproxy's own rule), which the usual None skips without a check
    steps = tuple((handler, inspect.iscoroutinefunction(handler)) for handler in handlers)

    async def hook(*args: Any) -> None:
        for handler, is_coroutine in steps:
            if is_coroutine:
                await handler(*args)
            elif (result := handler(*args)) is not None and inspect.isawaitable(result):
                await result

    return hook
