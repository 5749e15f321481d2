"""The README as written: a fresh clone of the committed tree, `make up` with no variables from
the clone's root, then the README's own curl command (read from README.md, so that editing the
README changes the test).

The one thing taken from this checkout is llama-cpp-python, built here already (compiling it
again would take minutes): the clone's `.venv` is a new virtualenv that sees this one's
packages through a `.pth` file, with the marker that says llama.cpp is built. `make up` does
the rest as for a user: installs Shoal from the clone, runs it on `./data`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from bus.embedded import port_in_use
from harness.shoal_up import read_until_ready, stop
from services.models.catalogue import card_for
from services.models.resolve import local_path
from tests.cli.shoal_up import REPO

pytestmark = pytest.mark.slow

README_PORT = 8000
# Variables an outer `make test` exports (MAKEFLAGS, CMAKE_ARGS...) and Shoal's own: a user
# typing `make up` in a new shell has none of them.
_NOT_A_USERS = re.compile(r"^(MAKE.*|MFLAGS|CMAKE_ARGS|SHOAL_.*|VIRTUAL_ENV)$")


def readme_curl(readme: str) -> str:
    """The README's first curl command, its continuation lines joined."""
    blocks: list[str] = re.findall(r"```sh\n(.*?)```", readme, re.DOTALL)
    commands = [b.replace("\\\n", " ") for b in blocks]
    lines = [line for c in commands for line in c.splitlines() if line.startswith("curl ")]
    assert lines, "README.md has no curl command in a ```sh block"
    return lines[0]


def test_the_readme_curl_is_found_whole() -> None:
    command = readme_curl((REPO / "README.md").read_text())
    assert command.startswith("curl http://127.0.0.1:8000/v1/chat/completions")
    assert '"model": "smollm2-135m"' in command and command.rstrip().endswith("'")


def _clone(into: Path) -> Path:
    clone = into / "shoal"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=120)
    # A new virtualenv that sees this checkout's packages (llama-cpp-python among them).
    subprocess.run([sys.executable, "-m", "venv", str(clone / ".venv")], check=True, timeout=120)
    purelib = sysconfig.get_paths()["purelib"]
    theirs = subprocess.run(
        [
            clone / ".venv" / "bin" / "python",
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(theirs, "shoal-test-reuse.pth").write_text(purelib + "\n")
    shutil.copy(REPO / ".venv" / ".installed-llama", clone / ".venv" / ".installed-llama")
    return clone


def _du(path: Path) -> int:
    """Bytes of disk ``path`` takes (blocks, not apparent sizes), links not followed."""
    out = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True)
    return int(out.stdout.split()[0])


@pytest.mark.timeout(600)
async def test_a_fresh_clone_make_up_then_the_readme_curl(tmp_path: Path) -> None:
    if port_in_use("127.0.0.1", README_PORT):
        pytest.fail(f"port {README_PORT}, the README's, is taken: this test needs it free")
    clone = await asyncio.to_thread(_clone, tmp_path)
    env = {k: v for k, v in os.environ.items() if not _NOT_A_USERS.match(k)}
    proc = subprocess.Popen(
        ["make", "up"],
        cwd=clone,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        lines = await read_until_ready(proc, timeout=300)
        assert any("--data-dir data" in line for line in lines)  # the README's relative path
        curl = await asyncio.to_thread(
            subprocess.run,
            ["bash", "-c", readme_curl((clone / "README.md").read_text())],
            cwd=clone,
            capture_output=True,
            text=True,
            # In the suite every core is busy. (Alone it takes a second.)
            timeout=300,
        )
        assert curl.returncode == 0, curl.stderr
        answer = json.loads(curl.stdout)
        assert answer["object"] == "chat.completion", answer
        assert answer["choices"][0]["message"]["content"].strip()

        # One copy of the model on this machine: its file (the package's), linked from both
        # caches; nothing of it under data/ (the JetStream store included).
        weights = local_path(card_for("smollm2-135m"), clone / "data" / "models")
        assert weights is not None
        size = weights.stat().st_size
        used = _du(clone / "data")
        print(f"data/ takes {used:,} bytes of disk beside the model's {size:,}")
        assert used <= 0.05 * size, f"data/ takes {used} bytes beside a {size}-byte model"
        link = clone / "data" / "worker" / "models" / "shared" / "smollm2-135m" / weights.name
        assert link.resolve() == weights.resolve()
    finally:
        rest = stop(proc)
        sys.stdout.write(rest[-2000:])
    assert "stopped" in rest
