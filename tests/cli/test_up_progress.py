"""What `shoal up` shows while its model gets ready."""

from __future__ import annotations

import io

from cli.up_progress import Step, UpProgress, model_steps, weights_step
from events.states import RunnerState
from projectors.rows import InstanceRow, RunnerRow
from projectors.state import ClusterState, Put


def _state(*rows: InstanceRow | RunnerRow) -> ClusterState:
    state = ClusterState()
    state.commit([Put(r) for r in rows])
    return state


def _runner(
    rid: str, node: str, state: RunnerState, rank: int, start: int, end: int, **kw: object
) -> RunnerRow:
    return RunnerRow(
        runner_id=rid,
        instance_id="i",
        node_id=node,
        device="cpu",
        state=state,
        rank=rank,
        world_size=2,
        start_layer=start,
        end_layer=end,
        **kw,  # type: ignore[arg-type]
    )


def test_an_instance_waiting_for_the_planner_has_no_measure_of_progress() -> None:
    state = _state(InstanceRow(instance_id="i", model_id="m", status="requested"))
    assert model_steps(state, "m") == [
        Step("placement:i", "placing i", "waiting for the planner", None)
    ]


def test_a_split_instance_shows_each_runner_with_its_layers_and_state() -> None:
    state = _state(
        InstanceRow(instance_id="i", model_id="m", status="placed"),
        _runner("r1", "b", "Downloading", 1, 15, 30, progress=0.25),
        _runner("r0", "a", "Ready", 0, 0, 15),
    )
    steps = model_steps(state, "m")
    assert [(s.label, s.status, s.fraction) for s in steps] == [
        ("placing i", "placed on 2 nodes", 1.0),
        ("runner on a (layers 0-14)", "ready", 1.0),
        ("runner on b (layers 15-29)", "downloading weights", 0.25),
    ]


def test_failures_and_rejections_say_why() -> None:
    state = _state(
        InstanceRow(instance_id="i", model_id="m", status="rejected", reason="m needs 8 GiB"),
        _runner("r0", "a", "Failed", 0, 0, 30, error="killed by SIGKILL"),
    )
    steps = model_steps(state, "m")
    assert [(s.status, s.failed) for s in steps] == [
        ("cannot be placed: m needs 8 GiB", True),
        ("failed: killed by SIGKILL", True),
    ]


def test_other_models_and_deleted_instances_are_left_out() -> None:
    state = _state(
        InstanceRow(instance_id="i", model_id="other", status="placed"),
        InstanceRow(instance_id="j", model_id="m", status="deleted"),
    )
    assert model_steps(state, "m") == []


def test_without_a_terminal_each_change_is_one_plain_line() -> None:
    out = io.StringIO()
    with UpProgress(out) as progress:
        progress.show([weights_step("m", None, "package x")])
        progress.show([weights_step("m", 0.5, "package x")])  # same status: no new line
        progress.show([weights_step("m", 1.0, "package x")])
    assert out.getvalue().splitlines() == [
        "m weights (package x): preparing",
        "m weights (package x): ready",
    ]


def test_on_a_terminal_steps_are_drawn_as_progress_bars() -> None:
    out = io.StringIO()
    with UpProgress(out, terminal=True) as progress:
        progress.show([Step("w", "m weights", "preparing", 0.5)])
    text = out.getvalue()
    assert "m weights" in text and "50%" in text and "━" in text
