"""ggml's RPC backend through ctypes: serve this machine's CPU or GPU to a remote llama.cpp,
or use remote ones.

llama-cpp-python has no API for it. Its build with ``-DGGML_RPC=on`` (the Makefile's) ships
``libggml-rpc``; the functions are called here on the very libraries libllama is linked with
(``libggml.so.0``, ``libggml-rpc.so.0``): a second copy of ggml loaded under another name would
keep its own backend registry, and llama.cpp would silently ignore the RPC devices.

llama.cpp's RPC protocol has no authentication and no encryption: anyone who reaches the port
can run code on the tensors it holds. Servers bind to the data-plane address only, which must be
on a trusted network.
"""

from __future__ import annotations

import ctypes
import socket
import time
from functools import cache
from pathlib import Path

import llama_cpp

# enum ggml_backend_dev_type (ggml-backend.h)
_DEVICE_TYPE_CPU = 0
_DEVICE_TYPE_GPU = 1
_DEVICE_TYPE_IGPU = 2


class RpcUnavailable(RuntimeError):
    """llama-cpp-python was built without the RPC backend."""


@cache
def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    loaded: list[ctypes.CDLL] = []
    for name in ("libggml.so.0", "libggml-rpc.so.0"):
        # By soname first: the copy libllama already loaded (importing llama_cpp loads it).
        try:
            loaded.append(ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL))
            continue
        except OSError:
            pass
        candidates = sorted(lib_dir.glob(name.replace(".so.0", ".so*")))
        if not candidates:
            raise RpcUnavailable(
                f"{name} not found in {lib_dir}: llama-cpp-python must be built with"
                " CMAKE_ARGS=-DGGML_RPC=on (`make` does)"
            )
        loaded.append(ctypes.CDLL(str(candidates[0]), mode=ctypes.RTLD_GLOBAL))
    ggml, rpc = loaded
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_register.restype = None
    rpc.ggml_backend_rpc_start_server.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_void_p),
    ]
    rpc.ggml_backend_rpc_start_server.restype = None
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    return ggml, rpc


def check_available() -> None:
    """Raises ``RpcUnavailable`` unless the RPC backend can be used."""
    _libs()


def serve(
    endpoint: str, n_threads: int, cache_dir: Path | None = None, accelerator: bool = False
) -> None:
    """Serve this machine's CPU, or with ``accelerator`` its first GPU (the process sees only
    the one its stage was placed on), at ``endpoint`` (host:port) to remote llama.cpp
    clients, one at a time, forever. Blocks; returns only if the server cannot start (port
    taken, bad address). ``cache_dir`` keeps received tensors, so that a head that restarts
    sends their hashes instead of the weights again."""
    ggml, rpc = _libs()
    if accelerator:
        device = ggml.ggml_backend_dev_by_type(_DEVICE_TYPE_GPU) or ggml.ggml_backend_dev_by_type(
            _DEVICE_TYPE_IGPU
        )
        if not device:
            raise RuntimeError("ggml has no GPU here: was llama.cpp built for this accelerator?")
    else:
        device = ggml.ggml_backend_dev_by_type(_DEVICE_TYPE_CPU)
        if not device:
            raise RuntimeError("ggml has no CPU device")
    devices = (ctypes.c_void_p * 1)(device)
    cache = str(cache_dir).encode() if cache_dir is not None else None
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    rpc.ggml_backend_rpc_start_server(endpoint.encode(), cache, n_threads, 1, devices)


def add_servers(endpoints: list[str]) -> None:
    """Make the RPC servers at ``endpoints`` devices that llama.cpp models load onto, in this
    order (llama.cpp puts RPC devices first in its device list, in registration order).
    Each server must be up: ggml aborts the process on one that does not answer."""
    ggml, rpc = _libs()
    for endpoint in endpoints:
        reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            raise RuntimeError(f"the RPC server at {endpoint} offers no device")
        ggml.ggml_backend_register(reg)


def wait_listening(endpoint: str, timeout: float) -> None:
    """Wait until something accepts TCP connections at ``endpoint``. (A connection that closes
    at once is harmless to an RPC server: it drops it and accepts the next.)"""
    host, port = split_endpoint(endpoint)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens at {endpoint} after {timeout:.0f} s") from None
            time.sleep(0.05)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def free_endpoint(host: str) -> str:
    """``host:port`` with a port that is free on ``host`` now. (Another process could take it
    before the server binds; the server then fails to start, and the runner with it.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
