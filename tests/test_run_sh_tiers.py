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

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAKE_SETUP = """#!/usr/bin/env bash
set -eu
echo "setup ran with $1 and $(command -v python3)" >> "$1.calls"
mkdir -p "$1/build/bin" "$1/models" "$1/router-models"
printf '#!/bin/sh\\n' > "$1/build/bin/llama-server" && chmod +x "$1/build/bin/llama-server"
for model in tiny-a tiny-b; do
  echo gguf > "$1/models/$model.gguf" && ln -sf "../models/$model.gguf" "$1/router-models/$model.gguf"
done
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


def environment(clone: Path, **env: str) -> dict[str, str]:
    """This environment without crossbar's variables and XDG_CACHE_HOME, with a HOME of its own and
    the stand-in npm first on PATH."""
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("CROSSBAR_") and k != "XDG_CACHE_HOME"}
    environ.update(HOME=str(clone.parent / "home"), NPM_CALLS=str(clone.parent / "npm.calls"),
                   PATH=f"{clone.parent / 'bin'}:{os.environ['PATH']}", **env)
    return environ


def split_run_sh(clone: Path) -> tuple[str, str]:
    """run.sh's settings and functions (everything before its `case`), and its `case`."""
    functions, case = (clone / "run.sh").read_text().split('\ncase "${1:-}" in', 1)
    return functions, 'case "${1:-}" in' + case


def run_functions(clone: Path, script: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`script` with run.sh's settings and functions defined, in the clone."""
    functions, _ = split_run_sh(clone)
    return subprocess.run(["bash", "-c", f"{functions}\n{script}"], cwd=clone,
                          env=environment(clone, **env), capture_output=True, text=True, timeout=120,
                          input="", check=False)


def run_test_command(clone: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`./run.sh test ARGS` as run.sh runs it, with the virtualenv, Chromium and PostgreSQL steps
    left out and a stand-in pytest that prints its arguments."""
    functions, case = split_run_sh(clone)
    fake = clone / "fakevenv" / "bin"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "python").write_text(
        '#!/usr/bin/env bash\n'
        'if [ "$1 $2" = "-m pytest" ]; then shift 2; echo "pytest ran: $*"; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n')
    (fake / "python").chmod(0o755)
    stubs = (f'VENV="{fake.parent}"\n'
             'ensure_venv() { :; }; ensure_chromium() { :; }; ensure_postgresql() { :; }\n')
    return subprocess.run(["bash", "-c", f"{functions}\n{stubs}{case}", "run.sh", "test", *args],
                          cwd=clone, env=environment(clone), capture_output=True, text=True,
                          timeout=120, input="", check=False)


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


@pytest.mark.parametrize(("args", "lab", "opencode"), [
    ((), True, True),
    (("-q",), True, True),
    (("-m", "real"), True, True),  # no test path: the whole suite, selected by marker
    (("tests/",), True, True),
    (("tests/test_lease.py", "-q"), False, False),
    (("-k", "lease", "tests/test_lease.py"), False, False),
    (("tests/test_real.py",), True, False),
    (("tests/test_opencode.py::test_opencode_run", "-x"), False, True),
    # an option's value that names a file is not a test path: the whole suite runs
    (("--ignore", "tests/test_lease.py"), True, True),
    (("--deselect", "tests/test_lease.py::test_x"), True, True),
    (("-q", "--junitxml", "report.xml"), True, True),
    (("-c", "pyproject.toml"), True, True),
])
def test_the_test_command_prepares_only_the_tiers_it_runs(
        tmp_path: Path, args: tuple[str, ...], lab: bool, opencode: bool) -> None:
    """`./run.sh test tests/test_lease.py` must not first build the lab (~6 min) or download
    OpenCode (~185 MB) for a file that uses neither."""
    clone = layout(tmp_path, with_setup=True)
    (clone / "tests").mkdir()
    for name in ("test_lease.py", "test_real.py", "test_opencode.py"):
        (clone / "tests" / name).write_text("")
    (clone / "report.xml").write_text("<testsuites/>")  # a report the previous run left
    (clone / "pyproject.toml").write_text("")
    done = run_test_command(clone, *args)
    assert done.returncode == 0, done.stderr
    assert f"pytest ran: {' '.join(args)}".rstrip() in done.stdout
    assert (tmp_path / "home" / ".cache" / "crossbar-llama-lab.calls").exists() == lab
    assert (tmp_path / "npm.calls").exists() == opencode


def test_a_lab_left_half_built_is_built_again(tmp_path: Path) -> None:
    """setup.sh makes tiny-a, links it, then makes tiny-b (the router test lists both): a build
    stopped in between must not count as a lab."""
    clone = layout(tmp_path, with_setup=True)
    lab = tmp_path / "home" / ".cache" / "crossbar-llama-lab"
    (lab / "build" / "bin").mkdir(parents=True)
    (lab / "build" / "bin" / "llama-server").write_text("#!/bin/sh\n")
    (lab / "build" / "bin" / "llama-server").chmod(0o755)
    (lab / "models").mkdir()
    (lab / "models" / "tiny-a.gguf").write_text("gguf")
    (lab / "router-models").mkdir()
    (lab / "router-models" / "tiny-a.gguf").symlink_to(lab / "models" / "tiny-a.gguf")
    done = run_functions(clone, "ensure_llama_lab")
    assert done.returncode == 0, done.stderr
    assert (lab / "models" / "tiny-b.gguf").exists(), "setup.sh did not run on a lab without tiny-b"
