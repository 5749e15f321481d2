"""`shoal events tail`: one line per event, coloured by kind."""

from __future__ import annotations

from rich.console import Console

from cli.event_line import event_line
from events.catalogue import NodeJoined, Resume, RunnerStateChanged, TaskCreated, TaskFailed


def test_events_are_coloured_by_aggregate_and_failures_are_red() -> None:
    assert "[bold cyan]NodeJoined[/]" in event_line(NodeJoined(node_id="a", origin="a"), 7)
    failed = TaskFailed(task_id="t", model_id="m", origin="r", error="boom")
    assert "[bold red]TaskFailed[/]" in event_line(failed)
    runner = dict(runner_id="r", instance_id="i", model_id="m", node_id="n", origin="n")
    assert "[bold yellow]RunnerStateChanged" in event_line(
        RunnerStateChanged(state="Ready", **runner)
    )
    assert "[bold red]RunnerStateChanged" in event_line(
        RunnerStateChanged(state="Failed", **runner)
    )


def test_a_terminal_gets_colours_and_a_pipe_plain_text() -> None:
    line = event_line(NodeJoined(node_id="a[x]", origin="a"), 3)
    console = Console(force_terminal=True, color_system="standard", width=200)
    with console.capture() as captured:
        console.print(line)
    assert "\x1b[1;36mNodeJoined" in captured.get()  # bold cyan
    plain = Console(force_terminal=False, width=200)
    with plain.capture() as captured:
        plain.print(line)
    text = captured.get()
    assert text.startswith("#3 ") and "NodeJoined node_id=a[x]" in text and "\x1b" not in text


def test_a_continuation_says_it_is_one_after_how_much_and_why() -> None:
    task = TaskCreated(task_id="t", model_id="m", origin="api", prompt="hi", kind="completion")
    assert "[bold green]TaskCreated[/] task_id=t" in event_line(task)
    resume = Resume(
        attempt=2,
        tokens=[1, 2, 3],
        runner_id="r0",
        reason="the runner serving this task killed by SIGKILL",
    )
    line = event_line(task.model_copy(update={"resume": resume}), 9)
    assert "[bold yellow]TaskCreated (resumed)[/] attempt=2 after=3 tokens lost=r0" in line
    assert "why=the runner serving this task killed by SIGKILL task_id=t" in line
    assert "tokens=" not in line
