"""The `shoal` command imports nats-py without aiohttp (bus/nats_import.py)."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
from bus.nats_import import import_nats_without_websockets
import_nats_without_websockets()
import nats.aio.transport
print("aiohttp" in sys.modules, nats.aio.transport.aiohttp is None)
import aiohttp  # still importable by anything else
print("aiohttp" in sys.modules)
"""


def test_nats_is_imported_without_aiohttp_which_stays_importable() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["False", "True", "True"]
