"""The machine profile sent with every heartbeat, measured on this machine for real."""

from __future__ import annotations

import ipaddress
import os
import shutil
from pathlib import Path

import psutil
import pytest

from events.catalogue import ResourceProfiled, parse_event
from events.units import GiB
from services.worker.profile import (
    collect_profile,
    cpu_model,
    disk_free,
    nvidia_gpus,
    parse_memory_limit,
    rss_bytes,
)


def test_the_profile_describes_this_machine(tmp_path: Path) -> None:
    models = tmp_path / "data" / "models"  # not created yet: the worker makes it on demand
    profile = collect_profile(models, None)
    assert profile.ram_total == psutil.virtual_memory().total
    assert 0 < profile.ram_available <= profile.ram_total
    assert profile.memory_offered == profile.ram_available  # no limit: all that is free
    assert profile.swap_used <= profile.swap_total
    assert profile.cpu_count == os.cpu_count()
    assert profile.cpu_model and profile.cpu_model == cpu_model()
    assert 0.0 <= profile.cpu_load <= 100.0
    # Free space of the filesystem the models will live on (give or take other writers).
    assert abs(profile.disk_free - shutil.disk_usage(tmp_path).free) < GiB
    assert not models.exists()  # measuring did not create it

    loopback = [i for i in profile.interfaces if "127.0.0.1" in i.addresses]
    assert len(loopback) == 1 and loopback[0].is_up
    for interface in profile.interfaces:
        for address in interface.addresses:  # IP addresses only, no MAC addresses
            ipaddress.ip_address(address.split("%")[0])  # fe80::1%eth0 names its interface
    assert all(i.speed_mbps is None or i.speed_mbps > 0 for i in profile.interfaces)


def test_no_nvidia_driver_means_no_gpus() -> None:
    # This machine has no NVIDIA driver: NVML's LibraryNotFound is "no GPUs", not an error,
    # and asking again gives the same answer without trying to load the library again.
    assert nvidia_gpus() == []
    assert nvidia_gpus() == []
    profile = collect_profile(Path("/"), None)
    assert profile.gpus == [] and profile.accelerators == []


def test_a_memory_limit_caps_what_is_offered(tmp_path: Path) -> None:
    capped = collect_profile(tmp_path, memory_limit=256 * 1024**2)
    assert capped.memory_offered == 256 * 1024**2 < capped.ram_available
    # A limit above what is free offers only what is free.
    roomy = collect_profile(tmp_path, memory_limit=1024 * GiB)
    assert roomy.memory_offered == roomy.ram_available
    # What the node's own runners hold is offered too: placement already counts their shards.
    with_runners = collect_profile(tmp_path, memory_limit=1024 * GiB, shoal_bytes=GiB)
    assert with_runners.memory_offered == with_runners.ram_available + GiB


def test_rss_of_runners() -> None:
    assert rss_bytes([os.getpid()]) > 10 * 1024**2
    assert rss_bytes([]) == 0
    assert rss_bytes([2**22 + 12345]) == 0  # no such process: counts nothing


def test_parse_memory_limit() -> None:
    assert parse_memory_limit("24G") == 24 * GiB
    assert parse_memory_limit("512M") == 512 * 1024**2
    assert parse_memory_limit("1000") == 1000
    assert parse_memory_limit("-1") is None  # no limit
    for bad in ("0", "lots", "-5G"):
        with pytest.raises(ValueError):
            parse_memory_limit(bad)


def test_disk_free_of_a_path_that_does_not_exist_yet(tmp_path: Path) -> None:
    assert disk_free(tmp_path / "a" / "b" / "c") == pytest.approx(
        shutil.disk_usage(tmp_path).free, abs=GiB
    )


def test_the_profile_survives_the_wire(tmp_path: Path) -> None:
    event = ResourceProfiled(
        node_id="n1", origin="n1", profile=collect_profile(tmp_path, memory_limit=GiB)
    )
    back = parse_event(event.to_json())
    assert back == event
    assert isinstance(back, ResourceProfiled)
    assert back.profile.interfaces == event.profile.interfaces
    assert back.subject == "shoal.events.node.n1.ResourceProfiled"
