"""The operator's dashboard at `GET /_crossbar/`: one self-contained HTML page (no build step, no
external assets) that polls the JSON admin endpoints and redraws itself."""

from __future__ import annotations

from functools import cache

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>crossbar</title></head>
<body><h1>crossbar</h1><p>Dashboard placeholder.</p></body></html>
"""


@cache
def page() -> bytes:
    return PAGE.encode()
