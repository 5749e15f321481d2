"""What this machine has to offer: the payload of ``ResourceProfiled``, the worker's heartbeat.

Everything here is read fresh on each call (memory, load and disk change all the time) except
what cannot change while the process runs: the CPU model, whether an NVIDIA driver exists, and
what the engines can run on (``device_probe``, asked once at start; NVIDIA GPUs' memory is read
through NVML at each call).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import platform
import socket
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil
import pynvml

from bus.streams import parse_size
from events.records import NetworkInterface, NodeProfile
from services.worker.device_probe import Probe
from services.worker.devices import NvidiaGpu, accelerators

log = logging.getLogger(__name__)


def parse_memory_limit(text: str) -> int | None:
    """``--memory-limit``: '24G', '512M', '1000' -> bytes; '-1' -> None (no limit)."""
    value = parse_size(text)
    if value == 0:
        raise ValueError("a memory limit of 0 would offer nothing to placement")
    return None if value < 0 else value


def collect_profile(
    models_dir: Path,
    memory_limit: int | None = None,
    shoal_bytes: int = 0,
    probe: Probe | None = None,
) -> NodeProfile:
    """A snapshot of this machine. ``memory_limit`` (bytes) caps what the node offers to
    placement: users keep memory for themselves, and tests make a small model "not fit".

    ``shoal_bytes`` is what this node's runners hold now. It counts as offered: placement
    already charges the shards placed here, and would count them twice otherwise.

    ``probe``: what the engines can run on (none: the CPU only, and any NVIDIA GPU is reported
    as seen but not usable)."""
    vm = psutil.virtual_memory()
    swap = psutil.swap_memory()
    budget = vm.available + shoal_bytes
    offered = budget if memory_limit is None else min(budget, memory_limit)
    return NodeProfile(
        ram_total=vm.total,
        ram_available=vm.available,
        swap_total=swap.total,
        swap_used=swap.used,
        cpu_count=psutil.cpu_count(logical=True) or 1,
        cpu_model=cpu_model(),
        # Non-blocking: the load since the previous call (the previous heartbeat). The very
        # first call in a process has nothing to compare with and says 0.0.
        cpu_load=psutil.cpu_percent(interval=None),
        disk_free=disk_free(models_dir),
        memory_offered=offered,
        interfaces=network_interfaces(),
        # Every GPU is an accelerator; `gpus` is what workers before them sent.
        accelerators=accelerators(
            probe.llamacpp if probe else [], nvidia_gpus(), probe.mlx if probe else None
        ),
    )


def rss_bytes(pids: Iterable[int]) -> int:
    """Resident memory of these processes (those that have exited count 0)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
    return total


@functools.cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            # x86 says "model name"; some ARM kernels only say "Hardware" or "Processor".
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Hardware", "Processor") and value.strip():
                return value.strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=2,
                check=True,
            )
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def disk_free(path: Path) -> int:
    """Free bytes on the filesystem that holds ``path``; the directory need not exist yet
    (the worker creates it on first download), so its nearest existing parent is measured."""
    return int(psutil.disk_usage(str(_existing(path))).free)


def disk_total(path: Path) -> int:
    """The size of the filesystem that holds ``path`` (or its nearest existing parent)."""
    return int(psutil.disk_usage(str(_existing(path))).total)


def _existing(path: Path) -> Path:
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def network_interfaces() -> list[NetworkInterface]:
    stats = psutil.net_if_stats()
    result = []
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        # IP addresses only: link-layer (MAC) entries are no use for reaching a peer.
        ips = [a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
        st = stats.get(name)
        result.append(
            NetworkInterface(
                name=name,
                addresses=ips,
                is_up=st.isup if st else False,
                # psutil says 0 when the speed is unknown (loopback, Wi-Fi, most VMs).
                speed_mbps=st.speed if st and st.speed > 0 else None,
            )
        )
    return result


# NVML errors that mean "this machine has no NVIDIA GPU to use", not that something broke.
_NO_GPU_ERRORS: tuple[type[Exception], ...] = tuple(
    getattr(pynvml, name)
    for name in (
        "NVMLError_LibraryNotFound",
        "NVMLError_DriverNotLoaded",
        "NVMLError_NoPermission",
        "NVMLError_NotFound",
        "NVMLError_FunctionNotFound",
        "NVMLError_Uninitialized",
    )
    if hasattr(pynvml, name)
)


@functools.cache
def _nvml_available() -> bool:
    """Initialise NVML once per process: a driver does not appear while a worker runs, and
    retrying every heartbeat on a CPU-only machine would only repeat the same failure."""
    try:
        pynvml.nvmlInit()
    except _NO_GPU_ERRORS:
        return False
    except pynvml.NVMLError as exc:
        log.warning("NVIDIA GPUs not profiled: NVML failed to start: %s", exc)
        return False
    return True


def nvidia_gpus() -> list[NvidiaGpu]:
    """The NVIDIA GPUs, or [] when there is no driver (a CPU-only machine, a Mac)."""
    if not _nvml_available():
        return []
    try:
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        log.warning("NVIDIA GPUs not profiled: %s", exc)
        return []
    gpus = []
    for index in range(count):
        try:
            gpus.append(_gpu(index))
        except pynvml.NVMLError as exc:
            # One GPU fallen off the bus should not hide the others, nor stop the heartbeat.
            log.warning("GPU %d not profiled: %s", index, exc)
    return gpus


def _gpu(index: int) -> NvidiaGpu:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    name: Any = pynvml.nvmlDeviceGetName(handle)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    utilisation: float | None
    try:
        utilisation = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except pynvml.NVMLError:
        utilisation = None  # not supported on some boards (e.g. some Jetsons, vGPUs)
    capability: str | None
    try:
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        capability = f"{major}.{minor}"
    except pynvml.NVMLError:
        capability = None
    bus: str | None
    try:
        bus = _str(pynvml.nvmlDeviceGetPciInfo(handle).busId)
    except pynvml.NVMLError:
        bus = None
    return NvidiaGpu(
        index=index,
        name=_str(name),
        memory_total=int(memory.total),
        memory_free=int(memory.free),
        utilisation=utilisation,
        compute_capability=capability,
        pci_bus_id=bus,
    )


def _str(value: Any) -> str:
    # Older nvidia-ml-py versions return bytes.
    return value.decode() if isinstance(value, bytes) else str(value)
