"""Parsing and checking the manual placement spec."""

from __future__ import annotations

import json
import re

import pytest

from events.kinds import DEFAULT_ROLE, INSTANCE_ROLES, InstanceRole
from services.planner.placement_spec import (
    ROLES,
    DeviceRef,
    PlacementSpec,
    PlacementSpecError,
    RolePlacement,
    parse_device,
    parse_placement_spec,
)


def chat(entry: object) -> str:
    """A spec with one chat entry, written as JSON."""
    return json.dumps({"chat": entry})


def devs(*texts: str) -> tuple[DeviceRef, ...]:
    return tuple(parse_device(t) for t in texts)


# --- devices -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "node_id", "device"),
    [
        ("node-a:cpu", "node-a", "cpu"),
        ("node-b:gpu0", "node-b", "gpu0"),
        ("node-b:gpu12", "node-b", "gpu12"),
        # Device names are case-insensitive and stored lowercase, without leading zeros.
        ("node-a:CPU", "node-a", "cpu"),
        ("node-a:GPU0", "node-a", "gpu0"),
        ("node-a:gpu00", "node-a", "gpu0"),
        ("node-a:Gpu007", "node-a", "gpu7"),
        # Accelerators are named by backend and index, as the workers report them.
        ("node-a:cuda0", "node-a", "cuda0"),
        ("node-a:CUDA01", "node-a", "cuda1"),
        ("node-a:rocm2", "node-a", "rocm2"),
        ("mac:Metal0", "mac", "metal0"),
        ("node-a:vulkan10", "node-a", "vulkan10"),
        ("node-a:sycl0", "node-a", "sycl0"),
        # Node ids keep their case, and any colons: the device follows the last one.
        ("Node-A:cpu", "Node-A", "cpu"),
        ("host:8080:gpu1", "host:8080", "gpu1"),
        ("[fe80::1]:cpu", "[fe80::1]", "cpu"),
        ("  node-a:cpu\n", "node-a", "cpu"),
    ],
)
def test_parse_device(text: str, node_id: str, device: str) -> None:
    ref = parse_device(text)
    assert ref == DeviceRef(node_id, device)
    assert parse_device(str(ref)) == ref


def test_device_str_kind_and_index() -> None:
    gpu = parse_device("node-b:GPU03")
    assert str(gpu) == "node-b:gpu3"
    assert (gpu.kind, gpu.index) == ("gpu", 3)
    cuda = parse_device("node-b:cuda07")
    assert (str(cuda), cuda.kind, cuda.index) == ("node-b:cuda7", "gpu", 7)
    cpu = parse_device("a:b:cpu")
    assert str(cpu) == "a:b:cpu"
    assert (cpu.kind, cpu.index) == ("cpu", None)


FORM = "write node:device, e.g. node-a:cpu or node-b:cuda0"
KINDS = "'cpu' or an accelerator such as 'cuda0', 'metal0', 'vulkan0' or 'gpu0'"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cpu", f"'cpu' is not a device: {FORM}"),
        ("node-a:", f"'node-a:' is not a device: {FORM}"),
        (":cpu", f"':cpu' is not a device: {FORM}"),
        ("", f"'' is not a device: {FORM}"),
        ("node a:cpu", "the node id 'node a' must not contain whitespace"),
        ("node-a:tpu", f"unknown device 'tpu': a device is {KINDS}"),
        ("node-a:cuda", "unknown device 'cuda'"),
        ("node-a:opencl0", "unknown device 'opencl0'"),
        ("node-a:cuda-2", "'node-a:cuda-2': device index must be >= 0, not -2"),
        ("node-a:gpux", "unknown device 'gpux'"),
        ("node-a:gpu", "unknown device 'gpu'"),
        ("node-a:cpu0", "unknown device 'cpu0'"),
        ("node-a:gpu-1", "'node-a:gpu-1': device index must be >= 0, not -1"),
    ],
)
def test_parse_device_rejects(text: str, message: str) -> None:
    with pytest.raises(PlacementSpecError, match=re.escape(message)):
        parse_device(text)


@pytest.mark.parametrize(("node_id", "device"), [("", "cpu"), ("a b", "cpu"), ("a", "GPU0")])
def test_device_ref_built_directly_must_be_canonical(node_id: str, device: str) -> None:
    with pytest.raises(PlacementSpecError):
        DeviceRef(node_id, device)


# --- whole specs -----------------------------------------------------------------------------


def test_parse_the_documented_example() -> None:
    spec = parse_placement_spec(
        '{"chat": {"devices": ["node-a:gpu0", "node-b:cpu"], "tensor_split": [3, 1],'
        ' "replicas": 1}}'
    )
    placement = spec.for_role(DEFAULT_ROLE)
    assert placement == RolePlacement(devs("node-a:gpu0", "node-b:cpu"), (3.0, 1.0), 1)


def test_optional_keys_default_and_null_means_absent() -> None:
    expected = RolePlacement(devs("node-a:cpu"))
    assert parse_placement_spec(chat({"devices": ["node-a:cpu"]})).for_role("chat") == expected
    spec = parse_placement_spec(
        chat({"devices": ["node-a:cpu"], "tensor_split": None, "replicas": None})
    )
    assert spec.for_role("chat") == expected


def test_whole_float_replicas_are_accepted() -> None:
    spec = parse_placement_spec(chat({"devices": ["n:cpu"], "replicas": 2.0}))
    assert spec.for_role("chat").replicas == 2
    assert isinstance(spec.for_role("chat").replicas, int)


def test_slots_are_optional_whole_numbers_up_to_64() -> None:
    assert parse_placement_spec(chat({"devices": ["n:cpu"]})).for_role("chat").slots is None
    spec = parse_placement_spec(chat({"devices": ["n:cpu"], "slots": 4.0}))
    assert spec.for_role("chat").slots == 4 and isinstance(spec.for_role("chat").slots, int)
    assert spec.to_json() == '{"chat":{"devices":["n:cpu"],"slots":4}}'
    assert parse_placement_spec(spec.to_json()) == spec
    for bad, message in [
        (0, "'slots' is 0: it must be between 1 and 64"),
        (65, "'slots' is 65: it must be between 1 and 64"),
        (1.5, "'slots' must be a whole number, not 1.5"),
        ("4", "'slots' must be a whole number, not the string '4'"),
        (True, "'slots' must be a whole number, not true"),
    ]:
        with pytest.raises(PlacementSpecError, match=re.escape(f"role 'chat': {message}")):
            parse_placement_spec(chat({"devices": ["n:cpu"], "slots": bad}))


def test_device_names_are_normalised_in_the_spec() -> None:
    spec = parse_placement_spec(chat({"devices": ["Node-A:GPU01", "node-b:CPU"]}))
    assert [str(d) for d in spec.for_role("chat").devices] == ["Node-A:gpu1", "node-b:cpu"]


EXAMPLE = "a placement is a JSON object keyed by role, e.g. {"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        # The document as a whole.
        ("{chat", "the placement is not valid JSON: Expecting property name"),
        ("", "the placement is not valid JSON: Expecting value: line 1 column 1"),
        ("[]", f"{EXAMPLE}"),
        ('"chat"', "not the string 'chat'"),
        (
            "{}",
            "the placement is empty: give an entry for at least one role"
            " (known roles: chat, embed, rerank)",
        ),
        (
            '{"embedx": {"devices": ["n:cpu"]}}',
            "unknown role 'embedx' (known roles: chat, embed, rerank)",
        ),
        (
            '{"chat": {"devices": ["n:cpu"]}, "chat": {"devices": ["m:cpu"]}}',
            "the placement has the key 'chat' twice in one object",
        ),
        # A role's entry.
        (chat(["n:cpu"]), "role 'chat': the entry must be a JSON object with 'devices'"),
        (chat("n:cpu"), "role 'chat': the entry must be a JSON object"),
        (
            chat({"devices": ["n:cpu"], "split": [1]}),
            "role 'chat': unknown key 'split' (allowed keys: devices, replicas, slots,"
            " tensor_split)",
        ),
        # devices
        (chat({}), "role 'chat': 'devices' is missing: list at least one device"),
        (chat({"devices": []}), "role 'chat': 'devices' is empty: list at least one device"),
        (chat({"devices": "n:cpu"}), "role 'chat': 'devices' must be a list like"),
        (chat({"devices": None}), "role 'chat': 'devices' must be a list like [\"node-a:cpu\"]"),
        (
            chat({"devices": ["n:cpu", 0]}),
            "role 'chat': devices[1] must be a string like \"node-a:cpu\", not the number 0",
        ),
        (chat({"devices": ["cpu"]}), f"role 'chat': devices[0]: 'cpu' is not a device: {FORM}"),
        (
            chat({"devices": ["n:cpu", "node-a:"]}),
            f"role 'chat': devices[1]: 'node-a:' is not a device: {FORM}",
        ),
        (chat({"devices": [":cpu"]}), f"role 'chat': devices[0]: ':cpu' is not a device: {FORM}"),
        (chat({"devices": ["node-a:tpu"]}), "role 'chat': devices[0]: 'node-a:tpu': unknown"),
        (chat({"devices": ["node-a:gpux"]}), "role 'chat': devices[0]: 'node-a:gpux': unknown"),
        (
            chat({"devices": ["node-a:gpu-1"]}),
            "role 'chat': devices[0]: 'node-a:gpu-1': device index must be >= 0",
        ),
        (
            chat({"devices": ["node-a:GPU0", "node-b:cpu", "node-a:gpu00"]}),
            "role 'chat': device 'node-a:gpu0' is listed twice (devices[0] and devices[2])",
        ),
        # tensor_split
        (
            chat({"devices": ["n:cpu"], "tensor_split": 1}),
            "role 'chat': 'tensor_split' must be a list of numbers, one weight per device, "
            "not the number 1",
        ),
        (
            chat({"devices": ["n:cpu"], "tensor_split": ["1"]}),
            "role 'chat': tensor_split[0] must be a number, not the string '1'",
        ),
        (
            chat({"devices": ["n:cpu"], "tensor_split": [True]}),
            "role 'chat': tensor_split[0] must be a number, not true",
        ),
        (
            chat({"devices": ["n:cpu", "m:cpu"], "tensor_split": [1, 2, 3]}),
            "role 'chat': tensor_split has 3 weights for 2 devices: give one weight per device",
        ),
        (
            chat({"devices": ["n:cpu", "m:cpu"], "tensor_split": [1]}),
            "role 'chat': tensor_split has 1 weight for 2 devices",
        ),
        (
            chat({"devices": ["n:cpu", "m:cpu"], "tensor_split": [1, 0]}),
            "role 'chat': tensor_split[1] is 0: weights must be > 0",
        ),
        (
            chat({"devices": ["n:cpu"], "tensor_split": [-0.5]}),
            "role 'chat': tensor_split[0] is -0.5: weights must be > 0",
        ),
        (
            '{"chat": {"devices": ["n:cpu"], "tensor_split": [NaN]}}',
            "role 'chat': tensor_split[0] is nan: weights must be finite numbers",
        ),
        (
            '{"chat": {"devices": ["n:cpu"], "tensor_split": [1e999]}}',
            "role 'chat': tensor_split[0] is inf: weights must be finite numbers",
        ),
        # replicas
        (
            chat({"devices": ["n:cpu"], "replicas": "2"}),
            "role 'chat': 'replicas' must be a whole number, not the string '2'",
        ),
        (
            chat({"devices": ["n:cpu"], "replicas": True}),
            "role 'chat': 'replicas' must be a whole number, not true",
        ),
        (
            chat({"devices": ["n:cpu"], "replicas": 1.5}),
            "role 'chat': 'replicas' must be a whole number, not 1.5",
        ),
        (
            chat({"devices": ["n:cpu"], "replicas": 0}),
            "role 'chat': 'replicas' is 0: it must be at least 1",
        ),
        (
            chat({"devices": ["n:cpu"], "replicas": -2}),
            "role 'chat': 'replicas' is -2: it must be at least 1",
        ),
        # replicas against devices
        (
            chat({"devices": ["a:cpu", "b:cpu", "c:cpu"], "replicas": 2}),
            "role 'chat': 3 devices cannot be shared evenly by 2 replicas: list one device per "
            "replica, or the same number of devices for each",
        ),
        (
            chat({"devices": ["a:cpu", "b:cpu"], "replicas": 4}),
            "role 'chat': 2 devices cannot be shared evenly by 4 replicas",
        ),
    ],
)
def test_malformed_specs_are_rejected_with_a_clear_message(raw: str, message: str) -> None:
    with pytest.raises(PlacementSpecError, match=re.escape(message)):
        parse_placement_spec(raw)


def test_the_not_an_object_message_shows_an_example_that_parses() -> None:
    with pytest.raises(PlacementSpecError) as caught:
        parse_placement_spec("[]")
    example = re.search(r"e\.g\. (\{.*\}), not a list$", str(caught.value))
    assert example is not None
    parse_placement_spec(example[1])


# --- replicas and their devices ------------------------------------------------------------


def test_one_replica_runs_across_all_devices() -> None:
    placement = RolePlacement(devs("a:gpu0", "b:cpu"), (3.0, 1.0))
    assert placement.groups() == [(devs("a:gpu0", "b:cpu"), (3.0, 1.0))]


def test_one_device_is_shared_by_every_replica() -> None:
    placement = RolePlacement(devs("a:gpu0"), replicas=3)
    assert placement.groups() == [(devs("a:gpu0"), None)] * 3


def test_one_device_per_replica() -> None:
    placement = RolePlacement(devs("a:cpu", "b:cpu"), replicas=2)
    assert placement.groups() == [(devs("a:cpu"), None), (devs("b:cpu"), None)]


def test_replicas_take_consecutive_blocks_with_their_weights() -> None:
    placement = RolePlacement(
        devs("a:gpu0", "a:gpu1", "b:gpu0", "b:cpu"), (1.0, 2.0, 3.0, 4.0), replicas=2
    )
    assert placement.groups() == [
        (devs("a:gpu0", "a:gpu1"), (1.0, 2.0)),
        (devs("b:gpu0", "b:cpu"), (3.0, 4.0)),
    ]


def test_role_placement_built_directly_is_checked() -> None:
    with pytest.raises(PlacementSpecError, match="3 devices cannot be shared evenly"):
        RolePlacement(devs("a:cpu", "b:cpu", "c:cpu"), replicas=2)


# --- JSON out and back ---------------------------------------------------------------------


def test_to_json_is_compact_sorted_and_leaves_out_defaults() -> None:
    spec = parse_placement_spec(chat({"replicas": 1, "devices": ["a:GPU0", "b:cpu"]}))
    assert spec.to_json() == '{"chat":{"devices":["a:gpu0","b:cpu"]}}'
    spec = parse_placement_spec(
        chat({"replicas": 2, "tensor_split": [3, 1.5], "devices": ["a:gpu0", "b:cpu"]})
    )
    assert spec.to_json() == (
        '{"chat":{"devices":["a:gpu0","b:cpu"],"replicas":2,"tensor_split":[3,1.5]}}'
    )


@pytest.mark.parametrize(
    "entry",
    [
        {"devices": ["node-a:cpu"]},
        {"devices": ["node-a:gpu0", "node-b:cpu"], "tensor_split": [3, 1]},
        {"devices": ["[fe80::1]:gpu1"], "replicas": 4},
        {"devices": ["a:gpu0", "a:gpu1", "b:gpu0", "b:gpu1"], "tensor_split": [0.1, 2.5, 1e-3, 7]},
    ],
)
def test_to_json_round_trips(entry: dict[str, object]) -> None:
    spec = parse_placement_spec(chat(entry))
    again = parse_placement_spec(spec.to_json())
    assert again == spec
    assert again.to_json() == spec.to_json()


# --- roles ---------------------------------------------------------------------------------


def test_roles_know_the_default() -> None:
    assert DEFAULT_ROLE in ROLES


def test_for_role_of_an_unknown_role() -> None:
    spec = parse_placement_spec(chat({"devices": ["n:cpu"]}))
    unknown = re.escape("unknown role 'summarise' (known roles:")
    with pytest.raises(PlacementSpecError, match=unknown):
        spec.for_role("summarise")


def test_the_embed_role_has_its_own_entry() -> None:
    spec = parse_placement_spec('{"embed": {"devices": ["node-a:cpu"]}}')
    assert spec.for_role("embed").devices == devs("node-a:cpu")
    with pytest.raises(
        PlacementSpecError,
        match=re.escape("the placement has no entry for role 'chat' (it has: embed)"),
    ):
        spec.for_role("chat")


def test_every_role_of_the_vocabulary_is_described_and_no_other_is_taken() -> None:
    assert set(ROLES) == set(INSTANCE_ROLES)
    with pytest.raises(PlacementSpecError, match=re.escape("(known roles: chat, embed, rerank)")):
        parse_placement_spec('{"summarise": {"devices": ["node-a:cpu"]}}')


def test_a_spec_cannot_be_changed_through_its_roles() -> None:
    roles: dict[InstanceRole, RolePlacement] = {"chat": RolePlacement(devs("n:cpu"))}
    spec = PlacementSpec(roles)
    roles.clear()
    assert spec.for_role("chat").devices == devs("n:cpu")
    with pytest.raises(TypeError):
        spec.roles["chat"] = RolePlacement(devs("m:cpu"))  # type: ignore[index]
