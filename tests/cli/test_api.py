"""``shoal api``'s options, as the API takes them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import typer

from api.model_defaults import ModelDefaults
from bus.embedded import free_port
from cli.api import model_defaults, reasoning_budget
from harness.processes import SHOAL


def test_the_reasoning_budget_option() -> None:
    assert reasoning_budget(-1) is None  # unbounded, the default
    assert reasoning_budget(512) == 512
    with pytest.raises(typer.Exit):
        reasoning_budget(0)  # a request turns the thinking off itself


def test_the_model_defaults_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert model_defaults(None, {}) == ModelDefaults()
    good = tmp_path / "defaults.json"
    good.write_text(json.dumps({"gpt-x": {"keep_alive": "10m"}, "m": {"pinned": True}}))
    read = model_defaults(good, {})
    assert read.by_name["gpt-x"].keep_alive_s == 600.0 and read.by_name["m"].pinned
    # The same file, where the API's --alias makes both names one model: refused.
    with pytest.raises(typer.Exit) as stopped:
        model_defaults(good, {"gpt-x": "m"})
    assert stopped.value.exit_code == 1
    assert capsys.readouterr().err == (
        f"error: --model-defaults {good}: models 'gpt-x' and 'm' are the same model (m):"
        " give its defaults once\n"
    )


@pytest.mark.slow
@pytest.mark.parametrize("command", ["api", "up"])
def test_a_bad_model_defaults_file_stops_the_command_before_it_starts(
    command: str, tmp_path: Path
) -> None:
    bad = tmp_path / "defaults.json"
    bad.write_text(json.dumps({"qwen3-8b": {"keep_alive": "soon"}}))
    data = tmp_path / "data"
    ran = subprocess.run(
        [SHOAL, command, "--model-defaults", str(bad), "--port", str(free_port("127.0.0.1"))]
        + (["--data-dir", str(data)] if command == "up" else []),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert (
        f"error: --model-defaults {bad}: model 'qwen3-8b': keep_alive: 'soon' is not a duration"
        in ran.stderr
    )
    assert not data.exists()  # nothing started: no log, no database
    # Relative, as a user types it: typer's error box cuts a long path short.
    missing = subprocess.run(
        [SHOAL, command, "--model-defaults", "none.json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert missing.returncode == 2 and "none.json" in missing.stderr  # typer: does not exist
