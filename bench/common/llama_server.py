"""llama.cpp's own ``llama-server``, built from the llama.cpp source that the installed
llama-cpp-python's source distribution carries (``vendor/llama.cpp``): the same engine version
as Shoal's, with the same CPU build flags (the Makefile's ``CMAKE_ARGS``), so that a benchmark
against it compares serving, not builds.

    .venv/bin/python -m bench.common.llama_server  # builds it (saying how long), prints its path

The build is kept in ``.bench/`` (by version) and reused.
"""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".bench"
# As the Makefile builds llama-cpp-python (portable, with the RPC backend).
DEFAULT_CMAKE_ARGS = "-DGGML_RPC=on -DGGML_NATIVE=off"


def llama_server(cache: Path = CACHE) -> Path:
    """The path of a built ``llama-server`` of the installed llama-cpp-python's version."""
    version = importlib.metadata.version("llama-cpp-python")
    where = cache / f"llama-server-{version}"
    binary = where / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    where.mkdir(parents=True, exist_ok=True)
    source = _source(version, where)
    flags = shlex.split(os.environ.get("CMAKE_ARGS", DEFAULT_CMAKE_ARGS))
    build = where / "build"
    print(f"building llama-server {version} from {source} ({' '.join(flags)})", file=sys.stderr)
    started = time.monotonic()
    subprocess.run(
        [
            "cmake",
            "-S",
            str(source),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=ON",
            *flags,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    jobs = str(os.cpu_count() or 1)
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    print(f"built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return binary


def _source(version: str, where: Path) -> Path:
    """``vendor/llama.cpp`` of llama-cpp-python's source distribution on PyPI."""
    unpacked = where / f"llama_cpp_python-{version}"
    if not unpacked.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={version}",
                "-d",
                str(where),
            ],
            check=True,
        )
        (sdist,) = where.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(where, filter="data")
    return unpacked / "vendor" / "llama.cpp"


if __name__ == "__main__":
    print(llama_server())
