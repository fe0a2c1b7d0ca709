"""The benchmark's bare mitmdump gets crossbar's own mitmproxy options in a form mitmproxy accepts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness import MITMDUMP, HostSpec, write_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench


def test_bare_mitmdump_options_parse(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.toml", {"a": ("http://127.0.0.1:9", HostSpec({"m": {}}))}, {"r": {}})
    cmd = bench.bare_mitmdump_cmd({1: 9}, cfg)
    assert "keep_host_header=true" in cmd
    sets = [arg for i, arg in enumerate(cmd) if i and cmd[i - 1] == "--set"]
    # `--options` prints the options and exits; any value mitmproxy cannot parse fails it
    args = [arg for s in sets for arg in ("--set", s)]
    done = subprocess.run([MITMDUMP, *args, "--options"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
