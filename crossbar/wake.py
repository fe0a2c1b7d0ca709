"""Wake-on-LAN for hosts that sleep: a magic packet, then wait for the host to pass health.

Concurrent requests that need the same host share one wake; waiting is async, other flows go on.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from crossbar.config import HostConf, WakeConf

log = logging.getLogger("crossbar.wake")

POLL_EVERY = 0.5


def magic_packet(mac: str) -> bytes:
    """6 × 0xFF followed by the MAC address 16 times."""
    raw = bytes.fromhex(mac.replace(":", "").replace("-", ""))
    if len(raw) != 6:
        raise ValueError(f"not a MAC address: {mac!r}")
    return b"\xff" * 6 + raw * 16


def send_magic_packet(wake: WakeConf) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        sock.sendto(magic_packet(wake.mac), (wake.broadcast.host, wake.broadcast.port))


class Waker:
    def __init__(
        self,
        hosts: Mapping[str, HostConf],
        healthy: Callable[[str], bool],
        poll: Callable[[str], Awaitable[None]],
        send: Callable[[WakeConf], None] = send_magic_packet,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.hosts, self.healthy, self.poll, self.send, self.clock = hosts, healthy, poll, send, clock
        self._waking: dict[str, asyncio.Task[bool]] = {}
        self.sent = 0

    def can_wake(self, host: str) -> bool:
        conf = self.hosts.get(host)
        return conf is not None and conf.wake is not None

    async def wake(self, names: Sequence[str]) -> list[str]:
        """Send every sleeping host among `names` (in that order) a magic packet and wait until one
        passes health or every wait ran out. Returns the hosts that were sent a packet."""
        targets = [n for n in names if self.can_wake(n) and not self.healthy(n)]
        if not targets:
            return []
        tasks = [self._wake_one(n) for n in targets]
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(t.result() for t in done):
                break
        return targets

    def _wake_one(self, name: str) -> asyncio.Task[bool]:
        task = self._waking.get(name)
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._run(name), name=f"crossbar-wake-{name}")
            self._waking[name] = task
        return task

    async def _run(self, name: str) -> bool:
        wake = self.hosts[name].wake
        assert wake is not None
        try:
            await asyncio.to_thread(self.send, wake)  # a broadcast host name resolves off the loop
            self.sent += 1
            log.warning("sent wake-on-LAN packet to %s (%s via %s)", name, wake.mac, wake.broadcast)
        except (OSError, ValueError) as exc:
            log.warning("could not send wake-on-LAN packet to %s: %s", name, exc)
            return False
        deadline = self.clock() + wake.wait
        while self.clock() < deadline:
            await self.poll(name)
            if self.healthy(name):
                log.warning("%s woke up", name)
                return True
            await asyncio.sleep(POLL_EVERY)
        log.warning("%s did not wake within %gs", name, wake.wait)
        return False
