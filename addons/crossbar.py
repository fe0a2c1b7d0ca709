"""mitmproxy entry point: `mitmdump -s addons/crossbar.py --set crossbar_config=crossbar.toml`.

All logic lives in the `crossbar` package next to this folder.
"""

import sys
from pathlib import Path

# mitmproxy puts this script's folder (addons/, which holds a crossbar.py) first on sys.path;
# the project root must come before it, also when PYTHONPATH already lists the root.
_ROOT = str(Path(__file__).resolve().parent.parent)
if sys.path[:1] != [_ROOT]:
    sys.path.insert(0, _ROOT)

from crossbar.addons import make_addon  # noqa: E402

addons = [make_addon()]
