"""`./run.sh demo`: one simulated llama-server per host of a crossbar config.

    python -m crossbar.demo example.toml          serve until SIGINT/SIGTERM
    python -m crossbar.demo --wait example.toml   wait until every host answers /health, print how
                                                  to point a client at crossbar, exit
A host listing one model is a single server; a host listing several is a router serving all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
import urllib.request

from crossbar.config import Config, ConfigError, HostConf, load_config
from llamasim import SimConfig, SimServer


def sim_config(host: HostConf) -> SimConfig:
    models = list(host.models)
    slots = max((m.parallel or 2) for m in host.models.values())
    return SimConfig(
        models=models, router=len(models) > 1, models_max=len(models), n_slots=slots,
        ctx=32768 * slots, token_ms=15.0, prompt_ms_per_token=0.02, default_max_tokens=64,
    )


async def serve(cfg: Config) -> None:
    sims = [SimServer(sim_config(h), host=h.host, port=h.port) for h in cfg.hosts.values()]
    for sim, (name, host) in zip(sims, cfg.hosts.items(), strict=True):
        await sim.start()
        served = ", ".join(host.models)
        print(f"demo: simulated llama-server {name} on {sim.url} serving {served}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for sim in sims:
        await sim.close()


def wait_ready(cfg: Config, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    pending = dict(cfg.hosts)
    while pending and time.monotonic() < deadline:
        for name, host in list(pending.items()):
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{host.base_url}/health",
                                                                      timeout=1) as resp:
                if resp.status == 200:
                    del pending[name]
        if pending:
            time.sleep(0.2)
    return not pending


def usage_hint(cfg: Config) -> str:
    route = next((r for r in cfg.routes.values() if not r.is_template), next(iter(cfg.routes.values())))
    name = route.name.replace("*", "demo")
    base = f"http://{cfg.listen}/{name}/v1"
    return "\n".join([
        "",
        f"crossbar demo: point a client at {base}",
        f"  curl -s {base}/chat/completions -H 'Content-Type: application/json' \\",
        "    -d '{\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}],\"stream\":true}'",
        f"  hosts:  curl -s http://{cfg.listen}/_crossbar/hosts",
        f"  leases: curl -s http://{cfg.listen}/_crossbar/routes",
        f"  usage:  curl -s -H 'Accept: text/plain' http://{cfg.listen}/_crossbar/usage",
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--wait", action="store_true", help="wait for the simulated hosts, print a hint, exit")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    if args.wait:
        if not wait_ready(cfg):
            print("demo: simulated hosts did not come up", file=sys.stderr)
            return 1
        print(usage_hint(cfg), flush=True)
        return 0
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
