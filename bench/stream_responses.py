"""Bare-mitmdump baseline that buffers requests like crossbar must (it reads the body to route
it) and streams responses: `mitmdump -s bench/stream_responses.py --mode reverse:...`."""

from mitmproxy import http


def responseheaders(flow: http.HTTPFlow) -> None:
    if flow.response is not None:
        flow.response.stream = True
