"""What the tests that run `shoal up` share: the model it serves and the API key it is given
(running it is ``harness/shoal_up.py``)."""

from __future__ import annotations

from pathlib import Path

MODEL = "smollm2-135m"
KEY = "test-key-1"
REPO = Path(__file__).resolve().parents[2]
