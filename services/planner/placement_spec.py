"""The manual placement spec: which devices run each role, and how.

A placement is a JSON object keyed by role. Each role's entry names the devices to use, each
qualified by the node it sits on, and optionally how to weight the model's layers across them,
how many replicas to run and how many tasks each serves at once::

    {"chat": {"devices": ["node-a:cuda0", "node-a:cuda1"], "tensor_split": [3, 1]}}

- ``devices`` (required, at least one): ``node:device`` strings. The device is ``cpu``, an
  accelerator named by its backend and index (``cuda0``, ``rocm1``, ``metal0``, ``vulkan0``,
  ``sycl0``), or ``gpu<index>`` (an NVIDIA GPU as older workers reported it);
  case-insensitive, stored lowercase (``CUDA00`` is ``cuda0``). A node id may itself contain
  ``:``; the device is whatever follows the last one.
- ``tensor_split`` (optional): one positive weight per device; a device's share of the model's
  layers is proportional to its weight. Without it the runner chooses.
- ``replicas`` (optional, default 1): how many copies of the model serve the role.
- ``slots`` (optional): how many tasks each replica serves at once, each with a KV cache of
  the whole context; without it, as many as fit (up to 8), chosen at placement.

How replicas use the devices:

- ``replicas`` 1: the one replica runs across all the devices, ``tensor_split`` being its
  weights: the devices of one node make one runner (llama.cpp splits the layers between
  them), and each node is a stage of a pipeline.
- one device: every replica runs on that device.
- ``k`` devices and ``n`` replicas with ``k`` a multiple of ``n``: replica ``i`` gets the
  ``i``-th consecutive block of ``k / n`` devices, and the matching slice of ``tensor_split``.

Anything else is rejected. This module only parses and validates; it does no I/O and does not
check that the nodes or devices exist.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from events.kinds import DEFAULT_ROLE, InstanceRole, is_role
from events.records import ACCELERATOR_BACKENDS
from services.json_input import kind, loads_strict
from services.models.footprint import MAX_SLOTS

# A new role is one new row here: parsing, checks and messages all read this table.
ROLES: dict[InstanceRole, str] = {
    "chat": "the model that answers chat completions",
    "embed": "the model that computes embeddings",
    "rerank": "the reranker that scores documents' relevance to a query",
}
MAX_REPLICAS = 64

_KEYS = ("devices", "replicas", "slots", "tensor_split")
_EXAMPLE = '{"chat": {"devices": ["node-a:cuda0", "node-b:cpu"], "tensor_split": [3, 1]}}'
_DEVICE_FORM = "write node:device, e.g. node-a:cpu or node-b:cuda0"
# Accelerators are named by backend; 'gpu' is how older workers named NVIDIA GPUs.
_PREFIXES = ("gpu", *ACCELERATOR_BACKENDS)
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_DEVICE_KINDS = "'cpu' or an accelerator such as 'cuda0', 'metal0', 'vulkan0' or 'gpu0'"
# What parse_device accepts (after lowercasing), and the canonical form DeviceRef holds.
_DEVICE_INPUT = re.compile(rf"({'|'.join(_PREFIXES)})(-?)([0-9]+)")
_DEVICE_CANONICAL = re.compile(rf"cpu|(?:{'|'.join(_PREFIXES)})(?:0|[1-9][0-9]*)")


class PlacementSpecError(ValueError):
    """A spec that is malformed; the message says exactly what and where."""


@dataclass(frozen=True)
class DeviceRef:
    """One device on one node: ``node-a:cpu``, ``node-b:cuda0``."""

    node_id: str
    device: str  # "cpu", or an accelerator ("cuda0", "gpu0"), canonical (lowercase, no 00)

    def __post_init__(self) -> None:
        # Built directly (not through parse_device) it must still print as a parseable device,
        # since placements travel as text in events.
        if not self.node_id or any(c.isspace() for c in self.node_id):
            raise PlacementSpecError(
                f"a node id must be non-empty and without whitespace, not {self.node_id!r}"
            )
        if not _DEVICE_CANONICAL.fullmatch(self.device):
            raise PlacementSpecError(
                f"a device is {_DEVICE_KINDS}, in lowercase, not {self.device!r}"
            )

    def __str__(self) -> str:
        return f"{self.node_id}:{self.device}"

    @property
    def kind(self) -> str:
        """``"cpu"`` or ``"gpu"``."""
        return "cpu" if self.device == "cpu" else "gpu"

    @property
    def index(self) -> int | None:
        """The accelerator's index among its backend's on its node; None for the CPU."""
        return None if self.device == "cpu" else int(self.device.lstrip(_LETTERS))


def parse_device(text: str) -> DeviceRef:
    """``"node-a:CUDA0"`` -> ``DeviceRef("node-a", "cuda0")``; PlacementSpecError if
    malformed."""
    value = text.strip()
    # The last colon: node ids such as "host:8080" or "[fe80::1]" keep theirs.
    node_id, colon, device = value.rpartition(":")
    if not colon or not node_id or not device:
        raise PlacementSpecError(f"{text!r} is not a device: {_DEVICE_FORM}")
    if any(c.isspace() for c in node_id):
        raise PlacementSpecError(f"{text!r}: the node id {node_id!r} must not contain whitespace")
    lowered = device.lower()
    if lowered == "cpu":
        return DeviceRef(node_id, "cpu")
    match = _DEVICE_INPUT.fullmatch(lowered)
    if match is None:
        raise PlacementSpecError(
            f"{text!r}: unknown device {device!r}: a device is {_DEVICE_KINDS}"
        )
    if match[2]:
        raise PlacementSpecError(f"{text!r}: device index must be >= 0, not -{match[3]}")
    return DeviceRef(node_id, f"{match[1]}{int(match[3])}")


@dataclass(frozen=True)
class RolePlacement:
    """The devices of one role, their weights, and the number of replicas.

    Constructing one checks that the parts fit together, so that groups() is always defined.
    """

    devices: tuple[DeviceRef, ...]
    tensor_split: tuple[float, ...] | None = None
    replicas: int = 1
    slots: int | None = None  # None: chosen at placement

    def __post_init__(self) -> None:
        if not self.devices:
            raise PlacementSpecError(
                "'devices' is empty: list at least one device, e.g. [\"node-a:cpu\"]"
            )
        first_seen: dict[DeviceRef, int] = {}
        for i, device in enumerate(self.devices):
            if device in first_seen:
                raise PlacementSpecError(
                    f"device '{device}' is listed twice (devices[{first_seen[device]}] "
                    f"and devices[{i}])"
                )
            first_seen[device] = i
        if self.tensor_split is not None:
            count, weights = len(self.devices), len(self.tensor_split)
            if weights != count:
                raise PlacementSpecError(
                    f"tensor_split has {weights} weight{_s(weights)} for {count} "
                    f"device{_s(count)}: give one weight per device"
                )
            for i, weight in enumerate(self.tensor_split):
                # Checked first: NaN compares false with everything, so "<= 0" would pass it.
                if not math.isfinite(weight):
                    raise PlacementSpecError(
                        f"tensor_split[{i}] is {weight}: weights must be finite numbers"
                    )
                if weight <= 0:
                    raise PlacementSpecError(
                        f"tensor_split[{i}] is {weight:g}: weights must be > 0"
                    )
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise PlacementSpecError(f"'replicas' must be a whole number, not {self.replicas!r}")
        if self.replicas < 1:
            raise PlacementSpecError(f"'replicas' is {self.replicas}: it must be at least 1")
        if self.replicas > MAX_REPLICAS:
            raise PlacementSpecError(
                f"'replicas' is {self.replicas}: at most {MAX_REPLICAS} replicas of one instance"
            )
        if self.slots is not None:
            if isinstance(self.slots, bool) or not isinstance(self.slots, int):
                raise PlacementSpecError(f"'slots' must be a whole number, not {self.slots!r}")
            if not 1 <= self.slots <= MAX_SLOTS:
                raise PlacementSpecError(
                    f"'slots' is {self.slots}: it must be between 1 and {MAX_SLOTS}"
                )
        count = len(self.devices)
        if count != 1 and count % self.replicas != 0:
            raise PlacementSpecError(
                f"{count} devices cannot be shared evenly by {self.replicas} replicas: "
                "list one device per replica, or the same number of devices for each"
            )

    def groups(self) -> list[tuple[tuple[DeviceRef, ...], tuple[float, ...] | None]]:
        """The devices (and their tensor_split weights, or None) of each replica, in replica
        order."""
        if len(self.devices) == 1:
            # Every replica shares the one device.
            return [(self.devices, self.tensor_split)] * self.replicas
        size = len(self.devices) // self.replicas
        split = self.tensor_split
        return [
            (
                self.devices[start : start + size],
                None if split is None else split[start : start + size],
            )
            for start in range(0, len(self.devices), size)
        ]


@dataclass(frozen=True)
class PlacementSpec:
    """A placement for one or more roles."""

    # Read-only, so that a frozen spec cannot change under whoever holds it; left out of the
    # hash because a mapping has none.
    roles: Mapping[InstanceRole, RolePlacement] = field(hash=False)

    def __post_init__(self) -> None:
        if not self.roles:
            raise PlacementSpecError(
                f"the placement is empty: give an entry for at least one role "
                f"(known roles: {_known_roles()})"
            )
        for role in self.roles:
            _check_role(role)
        object.__setattr__(self, "roles", MappingProxyType(dict(self.roles)))

    def to_json(self) -> str:
        """Compact JSON, keys sorted, defaults left out; parse_placement_spec reads it back."""
        out: dict[str, dict[str, Any]] = {}
        for role, placement in self.roles.items():
            entry: dict[str, Any] = {"devices": [str(d) for d in placement.devices]}
            if placement.tensor_split is not None:
                entry["tensor_split"] = [_weight_json(w) for w in placement.tensor_split]
            if placement.replicas != 1:
                entry["replicas"] = placement.replicas
            if placement.slots is not None:
                entry["slots"] = placement.slots
            out[role] = entry
        return json.dumps(out, sort_keys=True, separators=(",", ":"))

    def for_role(self, role: str) -> RolePlacement:
        try:
            return self.roles[_check_role(role)]
        except KeyError:
            raise PlacementSpecError(
                f"the placement has no entry for role {role!r} "
                f"(it has: {', '.join(sorted(self.roles))})"
            ) from None


def parse_placement_spec(raw: str) -> PlacementSpec:
    """Parse and check a placement; PlacementSpecError says what is wrong, and where."""
    try:
        data = loads_strict(
            raw,
            lambda key: PlacementSpecError(
                f"the placement has the key {key!r} twice in one object"
            ),
        )
    except PlacementSpecError:
        raise
    # ValueError also covers numbers too long to convert; RecursionError, absurd nesting.
    except (ValueError, RecursionError) as exc:
        raise PlacementSpecError(f"the placement is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise PlacementSpecError(
            f"a placement is a JSON object keyed by role, e.g. {_EXAMPLE}, not {kind(data)}"
        )
    roles: dict[InstanceRole, RolePlacement] = {}
    for role, entry in data.items():
        try:
            roles[_check_role(role)] = _parse_entry(entry)
        except PlacementSpecError as exc:
            raise PlacementSpecError(f"role {role!r}: {exc}") from None
    return PlacementSpec(roles)


def instance_role(raw: str | None, asked: str | None = None) -> InstanceRole:
    """The role an instance request is for: the one asked for, else the placement's only
    role (``{"embed": {...}}`` asks for an embed instance), else the default. A placement
    without an entry for that role is refused."""
    if raw is None:
        return _check_role(asked) if asked is not None else DEFAULT_ROLE
    spec = parse_placement_spec(raw)
    only = next(iter(spec.roles)) if len(spec.roles) == 1 else DEFAULT_ROLE
    role = _check_role(asked) if asked is not None else only
    spec.for_role(role)
    return role


def _parse_entry(entry: object) -> RolePlacement:
    if not isinstance(entry, dict):
        raise PlacementSpecError(
            "the entry must be a JSON object with 'devices' and optionally 'tensor_split', "
            f"'replicas' and 'slots', e.g. {{\"devices\": [\"node-a:cpu\"]}}, not {kind(entry)}"
        )
    for key in entry:
        if key not in _KEYS:
            raise PlacementSpecError(f"unknown key {key!r} (allowed keys: {', '.join(_KEYS)})")
    if "devices" not in entry:
        raise PlacementSpecError(
            "'devices' is missing: list at least one device, e.g. [\"node-a:cpu\"]"
        )
    # null for an optional key means "not given", as when the key is left out.
    tensor_split = entry.get("tensor_split")
    replicas = entry.get("replicas")
    slots = entry.get("slots")
    return RolePlacement(
        devices=_parse_devices(entry["devices"]),
        tensor_split=None if tensor_split is None else _parse_tensor_split(tensor_split),
        replicas=1 if replicas is None else _parse_whole(replicas, "replicas"),
        slots=None if slots is None else _parse_whole(slots, "slots"),
    )


def _parse_devices(value: object) -> tuple[DeviceRef, ...]:
    if not isinstance(value, list):
        raise PlacementSpecError(
            f"'devices' must be a list like [\"node-a:cpu\"], not {kind(value)}"
        )
    devices = []
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise PlacementSpecError(
                f'devices[{i}] must be a string like "node-a:cpu", not {kind(item)}'
            )
        try:
            devices.append(parse_device(item))
        except PlacementSpecError as exc:
            raise PlacementSpecError(f"devices[{i}]: {exc}") from None
    return tuple(devices)


def _parse_tensor_split(value: object) -> tuple[float, ...]:
    if not isinstance(value, list):
        raise PlacementSpecError(
            f"'tensor_split' must be a list of numbers, one weight per device, not {kind(value)}"
        )
    weights = []
    for i, item in enumerate(value):
        # bool is an int subclass, but true/false is no weight.
        if isinstance(item, bool) or not isinstance(item, int | float):
            raise PlacementSpecError(f"tensor_split[{i}] must be a number, not {kind(item)}")
        try:
            weights.append(float(item))
        except OverflowError:
            # An integer beyond float range; RolePlacement rejects it as not finite.
            weights.append(math.inf)
    return tuple(weights)


def _parse_whole(value: object, key: str) -> int:
    if isinstance(value, float) and value.is_integer():
        return int(value)  # 2.0 is 2: some JSON writers emit whole numbers as floats
    if isinstance(value, bool) or not isinstance(value, int):
        shown = repr(value) if isinstance(value, float) else kind(value)
        raise PlacementSpecError(f"'{key}' must be a whole number, not {shown}")
    return value


def _check_role(role: str) -> InstanceRole:
    if not is_role(role):
        raise PlacementSpecError(f"unknown role {role!r} (known roles: {_known_roles()})")
    return role


def _known_roles() -> str:
    return ", ".join(sorted(ROLES))


def _weight_json(weight: float) -> float | int:
    # [3, 1] reads better than [3.0, 1.0], and parses back to the same floats.
    return int(weight) if weight.is_integer() else weight


def _s(count: int) -> str:
    return "" if count == 1 else "s"
