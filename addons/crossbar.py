"""mitmproxy entry point: `mitmdump -s addons/crossbar.py --set crossbar_config=crossbar.toml`.

All logic lives in the `crossbar` package next to this folder.
"""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from crossbar.addon import make_addons  # noqa: E402

addons = make_addons()
