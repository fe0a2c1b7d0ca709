"""Pure parts of the context guard, wake-on-LAN and identity."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from types import MappingProxyType

import pytest
from samples_util import SAMPLES, load

from crossbar import identity
from crossbar.config import Address, HostConf, ModelConf, WakeConf
from crossbar.guard import TokenEstimator, _whole_tokens, fits, overflow
from crossbar.identity import FAILED_SECONDS, IdentityError, Tailscale, admitted, names_from_whois
from crossbar.wake import Waker, magic_packet

# ---------------------------------------------------------------- guard


@pytest.mark.parametrize(("tokens", "n_ctx", "ok"), [
    (100, 0, True),  # unknown context never blocks
    (2047, 2048, True),
    (2048, 2048, False),  # llama-server refuses n_prompt >= n_ctx
    (5000, 2048, False),
])
def test_fits(tokens: int, n_ctx: int, ok: bool) -> None:
    assert fits(tokens, n_ctx) is ok


def test_estimate_defaults_to_bytes_over_4_times_1_2() -> None:
    est = TokenEstimator()
    assert est.estimate("a", "m", 0) == 0
    assert est.estimate("a", "m", 1000) == 300
    assert est.estimate("a", "m", 4) == 2
    assert est.plain(1000) == 300


CHAT = "/v1/chat/completions"


def test_estimator_learns_the_tokens_per_byte_of_a_host_and_model() -> None:
    est = TokenEstimator()
    est.learn("a", "m", CHAT, 3000, 3019)  # the lab's tiny model: about one token per byte
    assert est.estimate("a", "m", 3000) == 3019  # measured on the model itself: no margin
    assert est.estimate("a", "other", 3000) == 900  # other models keep the default
    assert est.estimate("b", "m", 3000) == 900  # and so do other hosts
    est.learn("a", "m", CHAT, 100, 50_000)  # too short to say anything about the tokenizer
    est.learn("a", "m", CHAT, 5000, None)
    assert est.estimate("a", "m", 3000) == 3019


@pytest.mark.parametrize(("path", "prompt_bytes", "tokens", "learned"), [
    ("/v1/embeddings", 256, 90_256, None),  # token arrays: not text, never a sample
    (CHAT, 500, 1_000_000_000, None),  # a host reporting 1e9: outside the band
    (CHAT, 1000, 1, None),  # 0.001 tokens per byte: outside the band
    (CHAT, 1000, 1500, 1.5),  # the band's edge is believed
    ("/v1/completions", 1000, 300, 0.3),
])
def test_learning_is_bounded(path: str, prompt_bytes: int, tokens: int, learned: float | None) -> None:
    est = TokenEstimator()
    est.learn("a", "m", path, prompt_bytes, tokens)
    assert est.ratio("a", "m") == learned


def test_outliers_are_ignored_unless_they_agree_and_the_ratio_is_forgotten_in_time() -> None:
    now = [0.0]
    est = TokenEstimator(clock=lambda: now[0], forget_after=100)
    est.learn("a", "m", CHAT, 1000, 250)
    est.learn("a", "m", CHAT, 1000, 1400)  # 5.6× off: an outlier
    assert est.ratio("a", "m") == 0.25
    est.learn("a", "m", CHAT, 1000, 270)  # a believed sample resets the run of outliers
    assert est.ratio("a", "m") == pytest.approx(0.256)
    for _ in range(3):  # the model really changed: three outliers that agree re-seed it
        est.learn("a", "m", CHAT, 1000, 1000)
    assert est.ratio("a", "m") == 1.0
    now[0] = 101.0  # unconfirmed for longer than forget_after: back to the plain estimate
    assert est.ratio("a", "m") is None
    assert est.estimate("a", "m", 1000) == 300


@pytest.mark.skipif(not SAMPLES.is_dir(), reason="llama-lab samples not available")
def test_learned_estimate_is_better_than_bytes_over_4_on_the_real_servers_counts() -> None:
    """samples/single: a 3000-byte prompt is 3019 tokens, a 1200-byte one 1219 tokens. The fixed
    bytes/4 × 1.2 misses by a factor ~3; after learning from one reply the other is within 20 %."""
    overflow_tokens = load("single/overflow_nonstream.txt").json()["error"]["n_prompt_tokens"]
    cached_tokens = load("single/cache_run1.txt").json()["usage"]["prompt_tokens"]
    fixed = TokenEstimator()
    assert fixed.estimate("h", "tiny", 1200) < cached_tokens / 3
    learned = TokenEstimator()
    learned.learn("h", "tiny", CHAT, 3000, overflow_tokens)
    guess = learned.estimate("h", "tiny", 1200)
    assert abs(guess - cached_tokens) <= cached_tokens * 0.05


def test_overflow_uses_llama_servers_shape() -> None:
    err = overflow(3019, 2048)
    body = json.loads(err.body())
    assert err.status == 400
    assert body["error"]["type"] == "exceed_context_size_error"
    assert body["error"]["code"] == 400
    assert (body["error"]["n_prompt_tokens"], body["error"]["n_ctx"]) == (3019, 2048)
    assert body["error"]["message"].startswith("prompt too large")


# ---------------------------------------------------------------- wake


def test_magic_packet() -> None:
    pkt = magic_packet("aa:bb:cc:dd:ee:ff")
    assert len(pkt) == 102
    assert pkt[:6] == b"\xff" * 6
    assert pkt[6:] == bytes.fromhex("aabbccddeeff") * 16
    with pytest.raises(ValueError):
        magic_packet("aa:bb")


def wake_host(name: str, wait: float = 1.0) -> HostConf:
    return HostConf(name=name, base_url="http://127.0.0.1:9", scheme="http", host="127.0.0.1", port=9,
                    base_path="", models=MappingProxyType({"m": ModelConf()}),
                    wake=WakeConf(mac="aa:bb:cc:dd:ee:ff", broadcast=Address("127.0.0.1", 9), wait=wait))


async def test_waker_sends_in_route_order_and_returns_when_one_wakes() -> None:
    hosts = {"a": wake_host("a"), "b": wake_host("b"), "c": HostConf(
        name="c", base_url="http://127.0.0.1:9", scheme="http", host="127.0.0.1", port=9, base_path="")}
    up: set[str] = set()
    sent: list[str] = []
    polls: list[str] = []

    async def poll(name: str) -> None:
        polls.append(name)
        if name == "b" and len(polls) >= 3:
            up.add("b")

    def send(wake: WakeConf) -> None:
        sent.append(next(n for n, h in hosts.items() if h.wake is wake))

    waker = Waker(hosts, lambda n: n in up, poll, send=send)
    woke = await asyncio.wait_for(waker.wake(["b", "c", "a"]), 5)
    assert woke == ["b", "a"]  # c has no wake target
    assert sent == ["b", "a"]
    assert "b" in up


async def test_waker_gives_up_after_wait_and_shares_one_wake_between_callers() -> None:
    hosts = {"a": wake_host("a", wait=0.3)}
    sent: list[WakeConf] = []

    async def poll(name: str) -> None:
        return None

    waker = Waker(hosts, lambda n: False, poll, send=sent.append)
    results = await asyncio.wait_for(asyncio.gather(waker.wake(["a"]), waker.wake(["a"])), 5)
    assert results == [["a"], ["a"]]
    assert len(sent) == 1  # both requests waited on the same wake


async def test_waker_does_nothing_for_healthy_or_wakeless_hosts() -> None:
    hosts = {"a": wake_host("a")}

    async def poll(name: str) -> None:
        raise AssertionError("no poll expected")

    assert await Waker(hosts, lambda n: True, poll).wake(["a", "zzz"]) == []


# ---------------------------------------------------------------- identity

WHOIS = {
    "Node": {"ID": 1, "Name": "talos.tail1a2b.ts.net.", "ComputedName": "talos",
             "Hostinfo": {"Hostname": "Talos-Box", "OS": "linux"}},
    "UserProfile": {"ID": 7, "LoginName": "kyle@github", "DisplayName": "Kyle"},
}


def test_names_from_whois() -> None:
    assert names_from_whois(WHOIS) == {"talos", "talos.tail1a2b.ts.net", "kyle@github"}
    tagged = {"Node": {"Name": "ci-1.tail1a2b.ts.net.", "Tags": ["tag:ci"], "ComputedName": "talos",
                       "Hostinfo": {"Hostname": "talos"}},
              "UserProfile": {"LoginName": "tagged-devices"}}
    assert names_from_whois(tagged) == {"ci-1", "ci-1.tail1a2b.ts.net", "tag:ci"}
    assert names_from_whois([]) == frozenset()
    assert names_from_whois({"Node": "x"}) == frozenset()


@pytest.mark.parametrize(("peers", "names", "ok"), [
    ((), frozenset(), True),  # a route without peers is open
    (("talos",), frozenset({"talos"}), True),
    (("Talos",), frozenset({"talos"}), True),
    (("talos",), frozenset({"dixie"}), False),
    (("talos",), frozenset(), False),
])
def test_admitted(peers: tuple[str, ...], names: frozenset[str], ok: bool) -> None:
    assert admitted(peers, names) is ok


@pytest.mark.parametrize(("estimate", "tokens"), [
    (1000 * 0.25 * 1.2, 300),  # 300.00000000000006: float error, not a token more
    (300.0000004, 300),
    (300.000001, 301),
    (299.5, 300),
    (0.1, 1),
    (1e8 + 0.5, 100_000_001),
])
def test_an_estimate_is_rounded_up_past_float_error(estimate: float, tokens: int) -> None:
    assert _whole_tokens(estimate) == tokens == math.ceil(round(estimate, 6))


def counting_tailscale(tmp_path: Path, answer: str, delay: float = 0.3) -> tuple[Path, Path]:
    """A `tailscale` that notes each run in a file, waits, then prints `answer` (exit 1 if empty)."""
    calls, binary = tmp_path / "calls", tmp_path / "tailscale"
    reply = f"echo '{answer}'" if answer else "exit 1"
    binary.write_text(f"#!/bin/sh\necho x >> {calls}\nsleep {delay}\n{reply}\n")
    binary.chmod(0o755)
    return binary, calls


def runs(calls: Path) -> int:
    return len(calls.read_text().splitlines()) if calls.exists() else 0


WHOIS_JSON = json.dumps({"Node": {"Name": "talos.tail1a2b.ts.net.", "Tags": []},
                         "UserProfile": {"LoginName": "kyle@github"}})


async def test_requests_from_one_caller_share_one_lookup_and_one_that_leaves_costs_the_others_nothing(
        tmp_path: Path) -> None:
    """Each request of a burst ran its own `tailscale whois` (20 processes for one caller)."""
    binary, calls = counting_tailscale(tmp_path, WHOIS_JSON)
    ts = Tailscale(binary=str(binary))
    leaving = asyncio.ensure_future(ts.names("100.64.0.7"))
    staying = [asyncio.ensure_future(ts.names("100.64.0.7")) for _ in range(19)]
    await asyncio.sleep(0.05)
    leaving.cancel()
    assert all("talos" in names for names in await asyncio.gather(*staying))
    assert runs(calls) == 1
    assert "talos" in await ts.names("100.64.0.7") and runs(calls) == 1  # cached


async def test_a_failed_lookup_is_a_503_for_a_few_seconds_without_another_run(tmp_path: Path) -> None:
    binary, calls = counting_tailscale(tmp_path, "", delay=0)
    now = [0.0]
    ts = Tailscale(binary=str(binary), clock=lambda: now[0])
    for _ in range(3):
        with pytest.raises(IdentityError, match="failed"):
            await ts.names("100.64.0.9")
    assert runs(calls) == 1
    now[0] += FAILED_SECONDS
    with pytest.raises(IdentityError):
        await ts.names("100.64.0.9")
    assert runs(calls) == 2


async def test_the_lookup_cache_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(identity, "CACHE_MAX", 3)
    binary, calls = counting_tailscale(tmp_path, WHOIS_JSON, delay=0)
    ts = Tailscale(binary=str(binary))
    for i in range(5):
        await ts.names(f"100.64.0.{i}")
    await ts.names("100.64.0.4")  # still remembered
    assert runs(calls) == 5
    await ts.names("100.64.0.0")  # forgotten: looked up again
    assert runs(calls) == 6
