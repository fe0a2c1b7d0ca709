#!/usr/bin/env bash
# crossbar launcher.
#   ./run.sh [CONFIG]        run crossbar (CONFIG defaults to crossbar.toml, else example.toml)
#   ./run.sh test [ARGS]     run the test suite (ARGS go to pytest); first builds what the real
#                            tiers it runs need, when missing (the llama-server lab, OpenCode)
#   ./run.sh demo            simulated llama-servers + crossbar on example.toml
#   ./run.sh bench [ARGS]    the benchmarks (bench/bench.py)
#   ./run.sh install         only create .venv and install the pinned dependencies
# Creates .venv on first use (Python >= 3.12) and installs the pinned dependencies.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$HERE"
VENV="$HERE/.venv"

say() { printf 'run.sh: %s\n' "$*" >&2; }

python_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  local cand
  for cand in python3.13 python3.12 python3.14 python3; do
    if command -v "$cand" >/dev/null 2>&1 && python_ok "$cand"; then command -v "$cand"; return 0; fi
  done
  # pyenv installs that are not on PATH (a bare environment has no shims)
  for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
    if [ -x "$cand" ] && python_ok "$cand"; then echo "$cand"; return 0; fi
  done
  return 1
}

ensure_venv() {  # ensure_venv REQUIREMENTS_FILE
  local req=$1 stamp="$VENV/.crossbar-installed" want
  if [ ! -x "$VENV/bin/python" ] || ! python_ok "$VENV/bin/python"; then
    local py
    py=$(find_python) || {
      say "crossbar needs Python >= 3.12 (mitmproxy 12 requires it)."
      say "Looked for python3.13/python3.12/python3 on PATH and in \${PYENV_ROOT:-~/.pyenv}/versions/3.1[2-9]*."
      say "Install one (e.g. 'pyenv install 3.13') and run ./run.sh again."
      exit 1
    }
    say "creating .venv with $py"
    rm -rf "$VENV"
    "$py" -m venv "$VENV"
  fi
  want="$req $(cat "$req" requirements.txt constraints.txt | sha256sum | cut -c1-16)"
  if [ ! -f "$stamp" ] || ! grep -qxF "$want" "$stamp"; then
    say "installing pinned dependencies ($req)"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" -c constraints.txt
    echo "$want" >>"$stamp"
  fi
}

default_config() {
  if [ -f crossbar.toml ]; then echo crossbar.toml; else echo example.toml; fi
}

run_crossbar() {  # run_crossbar CONFIG [extra mitmdump args]
  local cfg=$1; shift
  [ -f "$cfg" ] || { say "no config file at $cfg (copy example.toml to crossbar.toml and edit it)"; exit 1; }
  # server=false: mitmproxy opens no default listener; crossbar opens the ones its TOML names.
  exec "$VENV/bin/mitmdump" -s "$HERE/addons/crossbar.py" --set "crossbar_config=$cfg" --set server=false "$@"
}

install_for_tests() {  # install_for_tests PACKAGE WHAT VARIABLE: Debian's PACKAGE, which WHAT needs
  local outcome="$2 will be skipped ($3=1 makes that a failure instead)"
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's $1 for $2"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null) \
      || say "could not install $1; $outcome"
  else
    say "$1 is not installed and cannot be installed here; $outcome"
  fi
}

ensure_chromium() {  # the dashboard test drives a headless browser
  command -v chromium >/dev/null 2>&1 || install_for_tests chromium "the dashboard test" CROSSBAR_BROWSER_TESTS
}

has_postgresql() {  # initdb beside its server: on PATH, else Debian's versioned directory
  local found
  found=$(command -v initdb 2>/dev/null) && [ -x "$(dirname "$(readlink -f "$found")")/postgres" ] && return 0
  for found in /usr/lib/postgresql/*/bin/initdb; do [ -x "$found" ] && return 0; done
  return 1
}

ensure_postgresql() {  # the PostgreSQL tests start a throwaway cluster (tests/pg.py)
  has_postgresql || install_for_tests postgresql "the PostgreSQL tests" CROSSBAR_PG_TESTS
}

tier_missing() {  # tier_missing VARIABLE WHY: a real tier cannot run; VARIABLE=1 makes that fatal
  if [ "${!1:-}" = 1 ]; then
    say "$2 ($1=1: the tier is required)"
    exit 1
  fi
  say "$2; that tier will be skipped ($1=1 makes this a failure)"
}

lab_built() {  # lab_built DIR: the llama-server and the tiny models setup.sh makes
  local model
  [ -x "$1/build/bin/llama-server" ] || return 1
  for model in tiny-a tiny-b; do
    [ -s "$1/models/$model.gguf" ] && [ -e "$1/router-models/$model.gguf" ] || return 1
  done
}

selects() {  # selects TIER_FILE [PYTEST ARGS]: the arguments run that test file (no test path
  # given: the whole suite; or a directory, or that file, named)
  local file=$1 arg target paths=0 value=0
  shift
  for arg in "$@"; do
    if [ "$value" = 1 ]; then value=0; continue; fi  # the value of the option before it
    case "$arg" in
      -k|-m|-p|-c|-o|-r|-W|--ignore|--ignore-glob|--deselect|--junitxml|--junit-xml|--rootdir|\
      --confcutdir|--basetemp|--override-ini|--log-file|--durations|--maxfail|--tb|--import-mode)
        value=1; continue ;;
      -*) continue ;;
    esac
    target=${arg%%::*}
    [ -e "$target" ] || continue  # not a path (a value given to some other option)
    paths=1
    if [ -d "$target" ] || [ "$(basename "$target")" = "$file" ]; then return 0; fi
  done
  [ "$paths" = 0 ]
}

ensure_llama_lab() {  # the real llama-server tier (tests/test_real.py) runs on the lab of ../shared
  local lab=${CROSSBAR_LLAMA_LAB:-${XDG_CACHE_HOME:-$HOME/.cache}/crossbar-llama-lab}
  local setup="$HERE/../shared/llama-lab/setup.sh" labpy
  export CROSSBAR_LLAMA_LAB="$lab"
  lab_built "$lab" && return 0
  if [ ! -f "$setup" ]; then
    tier_missing CROSSBAR_REAL_TESTS "no llama-server lab in $lab and no $setup beside the clone"
    return 0
  fi
  # setup.sh runs `pip download`, `pip install numpy pyyaml` and `python3` (gguf-py): it gets a
  # virtual environment of its own, because a distribution's python3 refuses `pip install`
  # (PEP 668, Debian 12) or has no pip at all
  labpy="$lab/.python"
  mkdir -p "$lab"
  if [ ! -x "$labpy/bin/pip" ]; then
    rm -rf "$labpy"
    "$VENV/bin/python" -m venv "$labpy"
  fi
  say "building the llama-server lab in $lab for the real tier (first time: about 6 minutes on 2 cores)"
  PATH="$labpy/bin:$PATH" bash "$setup" "$lab" >&2 || tier_missing CROSSBAR_REAL_TESTS "the lab build failed"
}

ensure_opencode() {  # the real OpenCode tier (tests/test_opencode.py) runs OpenCode 1.18.33
  local dir=${XDG_CACHE_HOME:-$HOME/.cache}/crossbar-opencode
  if [ -n "${CROSSBAR_OPENCODE:-}" ]; then return 0; fi
  export CROSSBAR_OPENCODE="$dir/node_modules/.bin/opencode"
  [ -x "$CROSSBAR_OPENCODE" ] && return 0
  if ! command -v npm >/dev/null 2>&1; then
    tier_missing CROSSBAR_OPENCODE_TESTS "npm is not installed"
    return 0
  fi
  say "installing OpenCode 1.18.33 in $dir for the real OpenCode tier (about 185 MB, once)"
  npm install --prefix "$dir" --no-audit --no-fund --loglevel=error opencode-ai@1.18.33 >&2 \
    || tier_missing CROSSBAR_OPENCODE_TESTS "could not install OpenCode"
}

case "${1:-}" in
  test)
    shift
    ensure_venv requirements-dev.txt
    ensure_chromium
    ensure_postgresql
    if selects test_real.py "$@"; then ensure_llama_lab; fi
    if selects test_opencode.py "$@"; then ensure_opencode; fi
    "$VENV/bin/python" -m pytest "$@"
    ;;
  demo)
    shift
    ensure_venv requirements.txt
    cfg=example.toml
    "$VENV/bin/python" -m crossbar.demo "$cfg" &
    sims=$!
    trap 'kill $sims 2>/dev/null || true; wait $sims 2>/dev/null || true' EXIT INT TERM
    "$VENV/bin/python" -m crossbar.demo --wait "$cfg"
    "$VENV/bin/mitmdump" -s "$HERE/addons/crossbar.py" --set "crossbar_config=$cfg" --set server=false "$@"
    ;;
  bench)
    shift
    ensure_venv requirements-dev.txt
    "$VENV/bin/python" bench/bench.py "$@"
    ;;
  install)
    ensure_venv requirements.txt
    ;;
  -h|--help|help)
    sed -n '2,9p' "$0"
    ;;
  *)
    # SIGHUP reloads once crossbar has loaded; until then it is ignored rather than fatal (systemd
    # takes a death by SIGHUP for a clean stop and would not restart the service)
    trap '' HUP
    ensure_venv requirements.txt
    run_crossbar "${1:-$(default_config)}" "${@:2}"
    ;;
esac
