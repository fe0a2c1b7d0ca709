"""The README's OpenCode recipe with the real OpenCode 1.18.33 binary: its wrapper names the route,
its provider snippet is the whole `opencode.json`, and `opencode run` then `opencode run --continue`
go through crossbar to simulated llama-servers; without the wrapper OpenCode gets crossbar's 404.

`./run.sh test` installs the binary (about 185 MB, once) when it is missing; run directly, the test
is skipped unless it is installed:
    npm install --prefix ~/.cache/crossbar-opencode opencode-ai@1.18.33
or `CROSSBAR_OPENCODE` names it (with CROSSBAR_OPENCODE_TESTS=1, as `.ci/run` sets, it fails
instead). OpenCode runs offline, in a throwaway HOME. Each run takes 20-40 s on two busy cores
(the binary's own start-up).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from harness import HostSpec, crossbar_proxy, request_rows, sim_fleet, write_config
from test_readme_clients import MODEL, PLACEHOLDER, PROVIDER, TEMPLATE_ROUTES, WRAPPER

from crossbar.session import KeyKind, key_kind
from llamasim import SimConfig

pytestmark = pytest.mark.opencode

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")  # where ./run.sh test installs it
OPENCODE = Path(os.environ.get("CROSSBAR_OPENCODE")
                or CACHE / "crossbar-opencode" / "node_modules" / ".bin" / "opencode")
OFFLINE = {name: "1" for name in (
    "OPENCODE_DISABLE_MODELS_FETCH", "OPENCODE_DISABLE_AUTOUPDATE", "OPENCODE_DISABLE_DEFAULT_PLUGINS",
    "OPENCODE_DISABLE_LSP_DOWNLOAD", "OPENCODE_DISABLE_SHARE")}
OUTPUT_LIMIT = 16  # the snippet's limit.output, made short so the simulated hosts answer fast
RUN_TIMEOUT = 300


def opencode_home(home: Path, proxy_url: str) -> dict[str, str]:
    """A throwaway HOME whose opencode.json is the README's snippet; the environment to run in."""
    conf = json.loads(PROVIDER.replace(PLACEHOLDER, proxy_url))
    conf["provider"]["crossbar"]["models"][MODEL]["limit"]["output"] = OUTPUT_LIMIT
    (home / ".config" / "opencode").mkdir(parents=True)
    (home / ".config" / "opencode" / "opencode.json").write_text(json.dumps(conf))
    xdg = {"XDG_CONFIG_HOME": ".config", "XDG_DATA_HOME": ".local/share", "XDG_CACHE_HOME": ".cache",
           "XDG_STATE_HOME": ".local/state"}
    return {"PATH": f"{OPENCODE.parent}:{os.environ['PATH']}", "HOME": str(home), **OFFLINE,
            **{k: str(home / v) for k, v in xdg.items()}}


async def opencode_run(rc: Path | None, project: Path, env: dict[str, str], *args: str,
                       status: int = 0) -> tuple[str, str]:
    """`opencode run ARGS` typed in `project` by a user whose shell rc holds the README's wrapper
    (without it when `rc` is None); stdout and stderr."""
    wrapper = f'. "{rc}"; ' if rc else ""
    script = wrapper + 'cd "$1"; shift; opencode run "$@"'
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", script, "bash", str(project), *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == status, err.decode(errors="replace")[-3000:]
    return out.decode(errors="replace"), err.decode(errors="replace")


async def test_opencode_run_and_continue_stay_on_one_session_lease(tmp_path: Path) -> None:
    if not os.access(OPENCODE, os.X_OK):
        if os.environ.get("CROSSBAR_OPENCODE_TESTS") == "1":
            pytest.fail(f"the real OpenCode tier is required (CROSSBAR_OPENCODE_TESTS=1): no OpenCode at "
                        f"{OPENCODE}")
        pytest.skip(f"OpenCode is not installed at {OPENCODE} (`./run.sh test` installs it, or npm install "
                    "--prefix ~/.cache/crossbar-opencode opencode-ai@1.18.33, or set CROSSBAR_OPENCODE)")
    sim = SimConfig(models=[MODEL], ctx=1 << 20)
    specs = {name: HostSpec({MODEL: {"parallel": 2}}, sim=sim) for name in ("alpha", "beta")}
    async with sim_fleet(specs) as fleet:
        cfg = write_config(tmp_path / "crossbar.toml", {n: (fleet[n].url, s) for n, s in specs.items()},
                           TEMPLATE_ROUTES)
        async with crossbar_proxy(cfg) as proxy:
            env = opencode_home(tmp_path / "home", proxy.url)
            rc = tmp_path / "rc.sh"
            rc.write_text(WRAPPER)
            project = tmp_path / "src" / "My Shop"
            project.mkdir(parents=True)
            await opencode_run(rc, project, env, "say hello")
            first = len(await request_rows(proxy))
            await opencode_run(rc, project, env, "--continue", "say more")
            rows = await request_rows(proxy)
            _, unset = await opencode_run(None, project, env, "say hello", status=1)  # no wrapper
            assert len(await request_rows(proxy)) == len(rows)  # nothing was forwarded
    assert "no route: put the route in the path" in unset
    assert first >= 2 and len(rows) > first  # the title and the main request, then a later turn
    assert {r.route for r in rows} == {"opencode-My-Shop"}
    assert {key_kind(r.fp) for r in rows} == {KeyKind.SESSION} and len({r.fp for r in rows}) == 1
    assert len({r.host for r in rows}) == 1
    assert [r.decision for r in rows] == ["new"] + ["reused"] * (len(rows) - 1)
    assert all(r.status == 200 and r.completion_tokens == OUTPUT_LIMIT for r in rows)  # limit.output
    resumed = rows[-1]
    assert resumed.cached_tokens and resumed.cached_tokens > 0.9 * resumed.prompt_tokens
