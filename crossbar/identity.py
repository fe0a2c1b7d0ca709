"""Who is calling: gates routes that list `peers`.

- `tailscale`: the caller's address is resolved with `tailscale whois --json ADDR`, cached
  briefly. A caller matches a peer by its node's MagicDNS name (short or full), one of its tags,
  or its owner's login name — names the coordination server assigns, never the hostname a node
  reports about itself. A missing or failing `tailscale` is a start-up error, and at request time a
  503 — never an open door.
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
    def __init__(self, binary: str = "tailscale", ttl: float = CACHE_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self.binary, self.ttl, self.clock = binary, ttl, clock
        self._cache: dict[str, tuple[float, frozenset[str]]] = {}

    async def check(self) -> str:
        """At start-up: the binary runs. Returns its version line."""
        if shutil.which(self.binary) is None:
            raise IdentityError(f"identity = \"tailscale\" but no {self.binary!r} executable is on PATH")
        out = await self._run("version")
        return out.splitlines()[0] if out else ""

    async def names(self, address: str) -> frozenset[str]:
        hit = self._cache.get(address)
        now = self.clock()
        if hit and now - hit[0] < self.ttl:
            return hit[1]
        out = await self._run("whois", "--json", address)
        try:
            names = names_from_whois(json.loads(out))
        except ValueError as exc:
            raise IdentityError(f"tailscale whois {address}: not JSON") from exc
        self._cache[address] = (now, names)
        return names

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
