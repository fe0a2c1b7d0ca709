"""mitmproxy script for `bench/lines.py`: counts the Python lines and calls of crossbar's code.

Loaded before crossbar's own script (`-s bench/linecount_addon.py -s addons/crossbar.py`), with
the option `linecount_root` naming the `crossbar` package folder whose code is counted (`/`: all
Python code in the process, the standard library's and installed packages' named by where they
sit in them). Counting
uses `sys.monitoring` (Python 3.12+) and is off until `GET /__linecount/start`; `GET
/__linecount/stop` switches it off and answers the counts as JSON:
`{"calls": {"module:function": n}, "lines": {"module:function:line": n}}`. Both paths are
answered here, before crossbar sees them.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections import Counter
from types import CodeType
from typing import Any

from mitmproxy import ctx, http
from mitmproxy.addonmanager import Loader

TOOL = sys.monitoring.PROFILER_ID
_SITE_PACKAGES = os.path.join(sysconfig.get_paths()["purelib"], "")
_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")
START, STOP = "/__linecount/start", "/__linecount/stop"


class LineCount:
    def __init__(self, root: str = "crossbar") -> None:
        self.root = os.path.join(os.path.abspath(root), "")
        self.calls: Counter[str] = Counter()
        self.lines: Counter[str] = Counter()
        self._names: dict[CodeType, str | None] = {}

    def _name(self, code: CodeType) -> str | None:
        """"module:function" for code under the root, None for any other (then not looked at again)."""
        if code not in self._names:
            self._names[code] = self._module(code.co_filename)
            if self._names[code] is not None:
                self._names[code] = f"{self._names[code]}:{code.co_qualname}"
        return self._names[code]

    def _module(self, filename: str) -> str | None:
        if self.root == os.sep and filename.startswith("<"):
            return filename  # code generated at run time (`<string>`: named tuples, dataclasses)
        path = os.path.abspath(filename)
        if not path.startswith(self.root):
            return None
        for prefix, label in ((_SITE_PACKAGES, "site-packages/"), (_STDLIB, "stdlib/")):
            if path.startswith(prefix):
                return label + path[len(prefix):]
        return os.path.relpath(path, self.root)

    def on_start(self, code: CodeType, offset: int) -> Any:
        name = self._name(code)
        if name is None:
            return sys.monitoring.DISABLE
        self.calls[name] += 1
        return None

    def on_line(self, code: CodeType, line: int) -> Any:
        name = self._name(code)
        if name is None:
            return sys.monitoring.DISABLE
        self.lines[f"{name}:{line}"] += 1
        return None

    def start(self) -> None:
        """Count from now on (a second start begins the count again)."""
        self.calls.clear()
        self.lines.clear()
        if sys.monitoring.get_tool(TOOL) is not None:
            return
        sys.monitoring.use_tool_id(TOOL, "crossbar-linecount")
        sys.monitoring.register_callback(TOOL, sys.monitoring.events.PY_START, self.on_start)
        sys.monitoring.register_callback(TOOL, sys.monitoring.events.LINE, self.on_line)
        sys.monitoring.set_events(TOOL, sys.monitoring.events.PY_START | sys.monitoring.events.LINE)

    def stop(self) -> dict[str, dict[str, int]]:
        """Stop counting (if it was on): what was counted since the start."""
        if sys.monitoring.get_tool(TOOL) is not None:
            sys.monitoring.set_events(TOOL, 0)
            sys.monitoring.free_tool_id(TOOL)
        return {"calls": dict(self.calls), "lines": dict(self.lines)}

    def load(self, loader: Loader) -> None:
        loader.add_option("linecount_root", str, "crossbar", "The package folder whose code is counted.")

    def configure(self, updated: set[str]) -> None:
        if "linecount_root" in updated:
            self.root = os.path.join(os.path.abspath(ctx.options.linecount_root), "")
            self._names.clear()

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.request.path == START:
            self.start()
            flow.response = http.Response.make(200, b"{}", {"content-type": "application/json"})
        elif flow.request.path == STOP:
            counts = json.dumps(self.stop()).encode()
            flow.response = http.Response.make(200, counts, {"content-type": "application/json"})


addons = [LineCount()]
