"""The README's "Pointing clients at it" recipes, taken from the README itself and run: the shell
wrapper that names the route, the template route it must match, OpenCode's provider (its base URL
filled the way OpenCode fills `{env:…}`, a set and an unset variable, the header alternative)
driving OpenCode 1.18.33's recorded requests, and the OpenAI SDK example as written."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import subprocess
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import ROOT, HostSpec, Proxy, crossbar_proxy, request_rows, sim_fleet, write_config
from test_sessions import MAIN, TITLE, replayed

from crossbar.config import parse_config
from crossbar.request import match_route, valid_route_name
from crossbar.session import key_kind, session_fp
from llamasim import SimConfig

README = (ROOT / "README.md").read_text()
SECTION = README[README.index("## Pointing clients at it"):README.index("## Operating it")]
PLACEHOLDER = "http://crossbar.<tailnet>:7777"


def fenced(lang: str, containing: str) -> str:
    """The README section's one ```lang block that contains `containing`, dedented."""
    blocks = [b for b in re.findall(rf"^( *)```{lang}\n(.*?)^\1```$", SECTION, re.S | re.M)
              if containing in b[1]]
    assert len(blocks) == 1, f"expected one ```{lang} block with {containing!r}, found {len(blocks)}"
    indent, text = blocks[0]
    return "\n".join(line.removeprefix(indent) for line in text.splitlines()) + "\n"


WRAPPER = fenced("sh", "opencode() {")
TEMPLATE_ROUTES = tomllib.loads(fenced("toml", '[routes."opencode-*"]'))["routes"]
PROVIDER = fenced("json", '"$schema"')
HEADER_OPTIONS = fenced("json", "X-Crossbar-Route")
SDK_EXAMPLE = fenced("python", "from openai import OpenAI")


def launched_routes(project: Path, tmp_path: Path, starts: int = 2) -> list[str]:
    """CROSSBAR_ROUTE as `opencode` sees it when started `starts` times in `project` through the
    README's wrapper (a stand-in `opencode` on PATH prints it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "opencode"
    fake.write_text('#!/bin/sh\nprintf "%s|%s\\n" "$CROSSBAR_ROUTE" "$*"\n')
    fake.chmod(0o755)
    rc = tmp_path / "rc.sh"
    rc.write_text(WRAPPER)
    script = f'. "{rc}"; cd "$1"; ' + "; ".join(["opencode run --continue"] * starts)
    out = subprocess.run(["bash", "-c", script, "bash", str(project)], capture_output=True, text=True,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, check=True).stdout
    lines = out.splitlines()
    assert all(line.endswith("|run --continue") for line in lines), lines  # arguments passed on
    return [line.split("|")[0] for line in lines]


def config_routes() -> dict[str, Any]:
    cfg = parse_config({"listen": "127.0.0.1:7777", "routes": TEMPLATE_ROUTES, "hosts": {
        name: {"base_url": "http://127.0.0.1:1", "models": ["ornith-1.5-35b-a3b"]} for name in HOSTS}})
    return dict(cfg.routes)


HOSTS = ("alpha", "beta")
MODEL = "ornith-1.5-35b-a3b"


@pytest.mark.parametrize(
    ("directory", "route"),
    [("shop", "opencode-shop"), ("My Shop (v2)", "opencode-My-Shop-v2-"), ("café", "opencode-caf-"),
     ("x" * 200, "opencode-" + "x" * 100)],
)
def test_the_wrapper_names_one_route_per_project_that_the_template_matches(
        tmp_path: Path, directory: str, route: str) -> None:
    project = tmp_path / "src" / directory
    project.mkdir(parents=True)
    names = launched_routes(project, tmp_path)
    assert names == [route, route]  # the same for every start in that directory
    assert valid_route_name(route)
    matched = match_route(route, config_routes())
    assert matched is not None and matched.name == route and matched.default_model == MODEL


def test_the_provider_snippet_is_valid_json_with_the_models_limit() -> None:
    provider = json.loads(PROVIDER)["provider"]["crossbar"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"]["baseURL"] == PLACEHOLDER + "/{env:CROSSBAR_ROUTE}/v1"
    ((model, conf),) = provider["models"].items()
    assert model == MODEL and json.loads(PROVIDER)["model"] == f"crossbar/{MODEL}"
    limit = conf["limit"]  # OpenCode's model schema: context and output are both required numbers
    assert isinstance(limit["context"], int) and isinstance(limit["output"], int)
    assert 0 < limit["output"] < limit["context"]


def opencode_options(snippet: str, proxy: Proxy, route: str | None) -> dict[str, Any]:
    """The provider options as OpenCode 1.18.33 uses them: `{env:VAR}` becomes the variable's
    value, or nothing when it is unset; then the text is parsed. It requests a base URL with an
    empty path segment without it (`/{env:CROSSBAR_ROUTE}/v1` unset asks for `/v1/...`), as
    `test_opencode.py` sees with the real binary."""
    text = snippet.replace("{env:CROSSBAR_ROUTE}", route or "").replace(PLACEHOLDER, proxy.url)
    parsed = json.loads(text if text.lstrip().startswith("{") else "{" + text + "}")  # whole file or part
    options = parsed["provider"]["crossbar"]["options"] if "provider" in parsed else parsed["options"]
    origin, _, path = options["baseURL"].partition("://")[2].partition("/")
    options["baseURL"] = f"http://{origin}/" + "/".join(seg for seg in path.split("/") if seg)
    return options


def recorded_requests(model: str, max_tokens: int) -> list[tuple[dict[str, str], dict[str, Any]]]:
    """OpenCode's title and main request, as it sends them for this provider's model."""
    requests = (replayed(record, max_tokens=max_tokens) for record in (TITLE, MAIN))
    return [(headers, {**body, "model": model}) for headers, body in requests]


@asynccontextmanager
async def readme_crossbar(tmp_path: Path) -> AsyncIterator[Proxy]:
    """crossbar with the README's template route and `opencode-a` (as in example.toml)."""
    sim = SimConfig(models=[MODEL], ctx=1 << 20)
    specs = {name: HostSpec({MODEL: {"parallel": 2}}, sim=sim) for name in HOSTS}
    async with sim_fleet(specs) as fleet:
        routes = {**TEMPLATE_ROUTES, "opencode-a": {"hosts": list(HOSTS), "default_model": MODEL}}
        cfg = write_config(tmp_path / "crossbar.toml", {n: (fleet[n].url, specs[n]) for n in HOSTS}, routes)
        async with crossbar_proxy(cfg) as proxy:
            yield proxy


async def post(url: str, headers: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as resp:
        raw = await resp.read()
        return resp.status, json.loads(raw) if resp.content_type == "application/json" else raw


@pytest.mark.parametrize("snippet", ["route in the base URL", "route in a header"])
async def test_opencode_through_the_readme_provider(tmp_path: Path, snippet: str) -> None:
    """A session's title and main request, then `opencode run --continue` (a later turn of the same
    session, started again through the wrapper), all on one lease; an unset variable is a 404."""
    text = PROVIDER if snippet == "route in the base URL" else HEADER_OPTIONS
    project = tmp_path / "src" / "My Shop"
    project.mkdir(parents=True)
    first_start, second_start = launched_routes(project, tmp_path)
    (title, main) = recorded_requests(MODEL, max_tokens=4)
    async with readme_crossbar(tmp_path) as proxy:
        for route, (headers, body) in ((first_start, title), (first_start, main), (second_start, main)):
            options = opencode_options(text, proxy, route)
            status, answer = await post(options["baseURL"] + "/chat/completions",
                                        {**headers, **options.get("headers", {})}, body)
            assert status == 200, answer
        unset = opencode_options(text, proxy, None)
        status, answer = await post(unset["baseURL"] + "/chat/completions",
                                    {**main[0], **unset.get("headers", {})}, main[1])
        rows = await request_rows(proxy)
    assert status == 404 and answer["error"]["message"].startswith("no route: put the route in the path")
    session = dict(main[0])["x-session-id"]
    assert [(r.route, r.fp, r.decision) for r in rows] == [
        ("opencode-My-Shop", session_fp(session), "new"),
        ("opencode-My-Shop", session_fp(session), "reused"),
        ("opencode-My-Shop", session_fp(session), "reused")]
    assert len({r.host for r in rows}) == 1


async def test_the_openai_sdk_example_runs_as_written(tmp_path: Path) -> None:
    async with readme_crossbar(tmp_path) as proxy:
        code = SDK_EXAMPLE.replace(PLACEHOLDER, proxy.url)
        printed = io.StringIO()

        def run() -> None:
            with contextlib.redirect_stdout(printed):
                exec(compile(code, "README.md (OpenAI Python SDK)", "exec"), {})

        await asyncio.to_thread(run)
        rows = await request_rows(proxy)
    assert printed.getvalue().strip()  # the streamed answer
    assert [r.decision for r in rows] == ["new", "reused", "reused"]
    assert {key_kind(r.fp) for r in rows} == {"session"} and len({r.fp for r in rows}) == 1
    assert {r.route for r in rows} == {"opencode-a"} and all(r.status == 200 for r in rows)
