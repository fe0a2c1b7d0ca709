"""`./run.sh test` prepares the real tiers it can (the llama-server lab of ../shared, OpenCode)
before pytest runs, so that on a fresh machine the README's test command runs them instead of
skipping them; a tier that cannot be prepared is skipped with a message, or fails the command when
its CROSSBAR_*_TESTS variable is 1 (as `.ci/run` sets). The functions are run from the real
run.sh, in a copy of the layout with a stand-in setup.sh and npm."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FAKE_SETUP = """#!/usr/bin/env bash
set -eu
echo "setup ran with $1 and $(command -v python3)" >> "$1.calls"
mkdir -p "$1/build/bin" "$1/models" "$1/router-models"
printf '#!/bin/sh\\n' > "$1/build/bin/llama-server" && chmod +x "$1/build/bin/llama-server"
echo gguf > "$1/models/tiny-a.gguf" && ln -sf ../models/tiny-a.gguf "$1/router-models/tiny-a.gguf"
"""

FAKE_NPM = """#!/usr/bin/env bash
set -eu
echo "npm $*" >> "$NPM_CALLS"
mkdir -p "$3/node_modules/.bin" && printf '#!/bin/sh\\n' > "$3/node_modules/.bin/opencode"
chmod +x "$3/node_modules/.bin/opencode"
"""


def layout(tmp: Path, with_setup: bool) -> Path:
    """tmp/clone/run.sh beside tmp/shared/llama-lab/setup.sh; the clone's .venv is this one's."""
    clone = tmp / "clone"
    clone.mkdir()
    shutil.copy(ROOT / "run.sh", clone / "run.sh")
    (clone / ".venv").symlink_to(Path(sys.prefix))
    if with_setup:
        lab = tmp / "shared" / "llama-lab"
        lab.mkdir(parents=True)
        (lab / "setup.sh").write_text(FAKE_SETUP)
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "npm").write_text(FAKE_NPM)
    (bin_dir / "npm").chmod(0o755)
    return clone


def run_functions(clone: Path, script: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`script` with run.sh's settings and functions (everything before its `case`), in the clone,
    with a HOME of its own and the stand-in npm first on PATH."""
    functions = (clone / "run.sh").read_text().split('\ncase "${1:-}" in', 1)[0]
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("CROSSBAR_") and k != "XDG_CACHE_HOME"}
    environ.update(HOME=str(clone.parent / "home"), NPM_CALLS=str(clone.parent / "npm.calls"),
                   PATH=f"{clone.parent / 'bin'}:{os.environ['PATH']}", **env)
    return subprocess.run(["bash", "-c", f"{functions}\n{script}"], cwd=clone, env=environ,
                          capture_output=True, text=True, timeout=120, input="", check=False)


def test_the_lab_and_opencode_are_prepared_once_when_missing(tmp_path: Path) -> None:
    clone = layout(tmp_path, with_setup=True)
    script = ('ensure_llama_lab; ensure_opencode; '
              'echo "lab=$CROSSBAR_LLAMA_LAB"; echo "opencode=$CROSSBAR_OPENCODE"')
    first = run_functions(clone, script)
    assert first.returncode == 0, first.stderr
    cache = tmp_path / "home" / ".cache"
    lab = cache / "crossbar-llama-lab"
    assert f"lab={lab}" in first.stdout
    assert f"opencode={cache}/crossbar-opencode/node_modules/.bin/opencode" in first.stdout
    calls = (cache / "crossbar-llama-lab.calls").read_text().splitlines()
    assert calls == [f"setup ran with {lab} and {lab}/.python/bin/python3"], calls  # in a venv of its own
    second = run_functions(clone, script)  # built and installed: nothing runs again
    assert second.returncode == 0, second.stderr
    assert len((cache / "crossbar-llama-lab.calls").read_text().splitlines()) == 1
    assert len((tmp_path / "npm.calls").read_text().splitlines()) == 1


def test_a_tier_that_cannot_be_prepared_is_skipped_or_required(tmp_path: Path) -> None:
    clone = layout(tmp_path, with_setup=False)
    script = "ensure_llama_lab; echo reached pytest"
    skipped = run_functions(clone, script)
    assert skipped.returncode == 0 and "reached pytest" in skipped.stdout
    assert "that tier will be skipped" in skipped.stderr
    required = run_functions(clone, script, CROSSBAR_REAL_TESTS="1")
    assert required.returncode == 1 and "reached pytest" not in required.stdout
    assert "CROSSBAR_REAL_TESTS=1: the tier is required" in required.stderr
