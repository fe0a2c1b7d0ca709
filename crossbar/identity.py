"""Who is calling: gates routes that list `peers`.

- `tailscale`: the caller's address is resolved with `tailscale whois --json ADDR`, one lookup
  per address at a time, cached briefly. A caller matches a peer by its node's MagicDNS name
  (short or full), one of its tags, or its owner's login name — names the coordination server
  assigns, never the hostname a node reports about itself. A missing or failing `tailscale` is a
  start-up error, and at request time a 503 — never an open door.
- `header`: trusts `X-Crossbar-Peer` (for tests; anyone can send it).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

PEER_HEADER = "x-crossbar-peer"
CACHE_SECONDS = 60.0
FAILED_SECONDS = 5.0  # a caller whose lookup failed gets 503s without a new lookup for this long
CACHE_MAX = 4096  # callers remembered; the least recently looked up go first
WHOIS_TIMEOUT = 5.0


class IdentityError(Exception):
    """The caller's identity could not be established."""


def names_from_whois(body: Any) -> frozenset[str]:
    """The names a `tailscale whois --json` answer gives the caller, lower-cased: only what the
    coordination server assigns — the node's MagicDNS name (full and short), its tags (`tag:ci`)
    and, for a node owned by a person, the owner's login. Never the OS hostname the node reports
    about itself (`Hostinfo.Hostname`), nor `ComputedName`, which falls back to that hostname."""
    if not isinstance(body, dict):
        return frozenset()
    names: set[str] = set()
    node = body.get("Node") if isinstance(body.get("Node"), dict) else {}
    name = node.get("Name")
    if isinstance(name, str) and name.strip("."):
        full = name.rstrip(".")
        names.update({full, full.split(".", 1)[0]})
    tags = node.get("Tags")
    tagged = isinstance(tags, list) and bool(tags)
    if tagged:
        names.update(t for t in tags if isinstance(t, str) and t.startswith("tag:"))
    user = body.get("UserProfile")
    if not tagged and isinstance(user, dict) and isinstance(user.get("LoginName"), str):
        names.add(user["LoginName"])  # a tagged node's "user" is the tagged-devices placeholder
    return frozenset(n.lower() for n in names if n)


def admitted(peers: Collection[str], names: Collection[str]) -> bool:
    return not peers or any(p.lower() in names for p in peers)


class Tailscale:
    """`tailscale whois` per caller address: one lookup at a time per address (the requests that
    arrive meanwhile share it), its answer cached for `ttl` seconds, a failure for FAILED_SECONDS."""

    def __init__(self, binary: str = "tailscale", ttl: float = CACHE_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self.binary, self.ttl, self.clock = binary, ttl, clock
        self._cache: dict[str, tuple[float, frozenset[str] | str]] = {}  # names, or why it failed
        self._lookups: dict[str, asyncio.Future[frozenset[str]]] = {}

    async def check(self) -> str:
        """At start-up: the binary runs. Returns its version line."""
        if shutil.which(self.binary) is None:
            raise IdentityError(f"identity = \"tailscale\" but no {self.binary!r} executable is on PATH")
        out = await self._run("version")
        return out.splitlines()[0] if out else ""

    async def names(self, address: str) -> frozenset[str]:
        hit = self._cache.get(address)
        if hit is not None:
            at, found = hit
            if self.clock() - at < (self.ttl if isinstance(found, frozenset) else FAILED_SECONDS):
                if isinstance(found, str):
                    raise IdentityError(found)
                return found
        lookup = self._lookups.get(address)
        if lookup is None:
            lookup = self._lookups[address] = asyncio.ensure_future(self._look_up(address))
            lookup.add_done_callback(lambda done: self._looked_up(address, done))
        # a request that leaves does not cancel the lookup the others wait for
        return await asyncio.shield(lookup)

    async def _look_up(self, address: str) -> frozenset[str]:
        try:
            out = await self._run("whois", "--json", address)
            try:
                names = names_from_whois(json.loads(out))
            except ValueError as exc:
                raise IdentityError(f"tailscale whois {address}: not JSON") from exc
        except IdentityError as exc:
            self._remember(address, str(exc))
            raise
        self._remember(address, names)
        return names

    def _remember(self, address: str, found: frozenset[str] | str) -> None:
        self._cache.pop(address, None)  # to the end: the oldest entries go first
        self._cache[address] = (self.clock(), found)
        while len(self._cache) > CACHE_MAX:
            del self._cache[next(iter(self._cache))]

    def _looked_up(self, address: str, done: asyncio.Future[frozenset[str]]) -> None:
        if self._lookups.get(address) is done:
            del self._lookups[address]
        if not done.cancelled():
            done.exception()  # retrieved: every waiter may have left

    async def _run(self, *args: str) -> str:
        try:
            proc = await asyncio.create_subprocess_exec(
                self.binary, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
        except OSError as exc:
            raise IdentityError(f"cannot run {self.binary}: {exc}") from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(), WHOIS_TIMEOUT)
        except TimeoutError as exc:
            proc.kill()
            await proc.wait()
            raise IdentityError(f"{self.binary} {' '.join(args)} timed out") from exc
        if proc.returncode != 0:
            lines = (err or out).decode(errors="replace").strip().splitlines()
            detail = lines[0] if lines else f"exit {proc.returncode}"
            raise IdentityError(f"{self.binary} {' '.join(args)} failed: {detail}")
        return out.decode(errors="replace")


class HeaderPeer:
    async def names_from(self, headers: Mapping[str, str]) -> frozenset[str]:
        value = headers.get(PEER_HEADER, "").strip().lower()
        return frozenset({value}) if value else frozenset()
