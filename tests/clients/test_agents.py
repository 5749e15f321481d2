"""Claude Code and Codex, as installed from the npm registry (``make clients``), run
non-interactively against one ``shoal up`` serving gemma3-270m at a 32k context, as their docs
say to point them at a local server (``tests/clients/cli.py``). Asserted on the protocol, not on
the small model's wisdom: every request they made was accepted (no refusal logged or counted),
their streams were read to the end, the usage they report is Shoal's, and a tool the model
called ran and its result came back to Shoal.

Each runs with a short system prompt and one tool (Claude Code's ``--system-prompt`` and
``--tools Bash``; Codex's ``model_instructions_file`` and two features off), options users have:
their whole prompts (12k and 10k tokens) take this 2-core machine more than a minute each to
read, and ``tests/api/test_client_bodies.py`` checks those, as the CLIs recorded them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bus.embedded import free_port
from harness.shoal_up import Drained, read_until_ready, start
from tests.clients.cli import CLAUDE_TOOL_PROMPT, CODEX_TOOL_PROMPT, TOOL_WORD, claude, codex

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"
CONTEXT = 32768
SHOAL = str(Path(sys.executable).with_name("shoal"))
TIMEOUT_S = 240
# Claude Code's answers are cut here (CLAUDE_CODE_MAX_OUTPUT_TOKENS): a 270M model may ramble.
MAX_OUTPUT = "48"
# Codex asks for no limit, and no setting of its sets one: Shoal's (--max-tokens) cuts its
# answers, as llama-server's --n-predict would.
CODEX_MAX_OUTPUT = 48
CLAUDE_ARGS = (
    "--tools",
    "Bash",
    "--system-prompt",
    "You are a coding agent. Use the Bash tool to run shell commands.",
    "--output-format",
    "stream-json",
    "--verbose",
)


@dataclass
class Shoal:
    root: str  # http://127.0.0.1:PORT
    output: Drained


@pytest.fixture(scope="module")
def shoal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shoal]:
    port = free_port("127.0.0.1")
    argv = [SHOAL, "up", "--data-dir", "data", "--port", str(port), "--model", MODEL]
    argv += ["--context", str(CONTEXT), "--slots", "2", "--max-tokens", str(CODEX_MAX_OUTPUT)]
    threads = os.environ.get("SHOAL_TEST_RUNNER_THREADS", "2")
    proc = start([*argv, "--runner-threads", threads], cwd=tmp_path_factory.mktemp("agents"))
    asyncio.run(read_until_ready(proc, timeout=300))
    drained = Drained(proc)
    try:
        yield Shoal(f"http://127.0.0.1:{port}", drained)
    finally:
        rest = drained.stop()
        sys.stdout.write(rest[-3000:])


def refusals(shoal: Shoal) -> list[str]:
    """What Shoal refused so far, as its log says (api/refusals.py)."""
    return [line for line in shoal.output.lines if "api.refused" in line]


def refused_count(root: str) -> float:
    metrics = httpx.get(f"{root}/metrics", timeout=30).text
    found = re.findall(r"^shoal_http_requests_refused_total\{[^}]*\} (\S+)$", metrics, re.M)
    return sum(float(n) for n in found)


def json_lines(text: str) -> Iterator[dict[str, Any]]:
    for line in text.splitlines():
        if line.startswith("{"):
            yield json.loads(line)


def _claude(shoal: Shoal, prompt: str) -> list[dict[str, Any]]:
    result = claude(
        shoal.root,
        MODEL,
        prompt,
        TIMEOUT_S,
        *CLAUDE_ARGS,
        env_extra={"CLAUDE_CODE_MAX_OUTPUT_TOKENS": MAX_OUTPUT},
    )
    messages = list(json_lines(result.stdout))
    assert messages and messages[-1]["type"] == "result", result.stdout[-2000:] + result.stderr
    return messages


def _claude_protocol(shoal: Shoal, messages: list[dict[str, Any]]) -> None:
    """What every Claude Code run against Shoal shows: its requests answered, each reply's
    stop read (a cut one is Claude Code's own max_output_tokens, as Anthropic's API says it),
    the usage Shoal counted."""
    final = messages[-1]
    assert final["api_error_status"] is None, final
    assert final.get("api_error") in (None, "max_output_tokens"), final
    assert final["usage"]["input_tokens"] + final["usage"]["cache_read_input_tokens"] > 500
    assert final["usage"]["output_tokens"] > 0
    # Shoal's replies (Claude Code adds "<synthetic>" ones of its own, saying a reply was cut).
    replies = [m for m in messages if m["type"] == "assistant"]
    assert replies and all(r["message"]["model"] in (MODEL, "<synthetic>") for r in replies)
    assert any(r["message"]["model"] == MODEL for r in replies)
    assert not refusals(shoal), refusals(shoal)


def test_claude_code_answers_a_prompt(shoal: Shoal) -> None:
    messages = _claude(shoal, "Say hello in one word.")
    _claude_protocol(shoal, messages)
    texts = [
        b["text"]
        for m in messages
        if m["type"] == "assistant"
        for b in m["message"]["content"]
        if b["type"] == "text"
    ]
    assert any(t.strip() for t in texts)


def test_claude_code_s_tool_round_trip(shoal: Shoal) -> None:
    messages = _claude(shoal, CLAUDE_TOOL_PROMPT)
    _claude_protocol(shoal, messages)
    uses = [
        b
        for m in messages
        if m["type"] == "assistant"
        for b in m["message"]["content"]
        if b["type"] == "tool_use"
    ]
    results = [
        b
        for m in messages
        if m["type"] == "user"
        for b in m["message"]["content"]
        if isinstance(b, dict) and b.get("type") == "tool_result"
    ]
    # Each call the model made ran, and its result went back to Shoal (the next request).
    assert len(results) == len(uses)
    if any(u["name"] == "Bash" and TOOL_WORD in json.dumps(u["input"]) for u in uses):
        assert any(TOOL_WORD in json.dumps(r["content"]) for r in results)
    assert refused_count(shoal.root) == 0


# A tool round trip is stopped after this long if the model is still calling tools (a small
# model may go on calling them, each answer cut by Shoal's limit), and what ran is checked.
CODEX_TOOL_S = 90


def _codex(
    shoal: Shoal, prompt: str, tmp_path: Path, timeout: float = TIMEOUT_S
) -> tuple[int | None, list[dict[str, Any]], str]:
    """Codex's exit status (None: still running after ``timeout``, then stopped), its JSON
    events so far and its stderr."""
    instructions = tmp_path / "instructions.md"
    instructions.write_text("You are a coding agent. Run shell commands with exec_command.\n")
    args = ["-c", f"model_instructions_file={json.dumps(str(instructions))}"]
    args += ["--disable", "multi_agent", "--disable", "goals"]
    try:
        result = codex(f"{shoal.root}/v1", MODEL, prompt, timeout, *args)
    except subprocess.TimeoutExpired as stopped:
        out, err = (
            x.decode() if isinstance(x, bytes) else x or ""
            for x in (stopped.output, stopped.stderr)
        )
        return None, list(json_lines(out)), err
    return result.returncode, list(json_lines(result.stdout)), result.stderr


def _codex_protocol(shoal: Shoal, code: int | None, events: list[dict[str, Any]], err: str) -> None:
    """Every request Codex made accepted and read; a run stopped while the model still called
    tools (``code`` None) shows its turn going on without an error."""
    kinds = [e["type"] for e in events]
    assert "turn.failed" not in kinds and "error" not in kinds, (kinds, err[-2000:])
    assert not refusals(shoal), refusals(shoal)
    if code is None:
        assert "turn.started" in kinds, (kinds, err[-2000:])
        return
    assert code == 0, (kinds, err[-2000:])
    assert "turn.completed" in kinds
    usage = next(e for e in events if e["type"] == "turn.completed")["usage"]
    assert usage["input_tokens"] > 500 and usage["output_tokens"] > 0


def test_codex_answers_a_prompt(shoal: Shoal, tmp_path: Path) -> None:
    code, events, err = _codex(shoal, "Say hello in one word.", tmp_path)
    assert code is not None, "Codex did not end its turn"
    _codex_protocol(shoal, code, events, err)
    items = [e["item"] for e in events if e["type"] == "item.completed"]
    messages = [i for i in items if i["type"] == "agent_message"]
    assert messages and messages[-1]["text"].strip(), items


def test_codex_s_tool_round_trip(shoal: Shoal, tmp_path: Path) -> None:
    code, events, err = _codex(shoal, CODEX_TOOL_PROMPT, tmp_path, timeout=CODEX_TOOL_S)
    _codex_protocol(shoal, code, events, err)
    commands = [
        e["item"]
        for e in events
        if e["type"] == "item.completed" and e["item"]["type"] == "command_execution"
    ]
    # A command the model ran came back with its output (then the turn went on to its end).
    for command in commands:
        assert command["status"] in ("completed", "failed")
        if TOOL_WORD in command["command"]:
            assert TOOL_WORD in command["aggregated_output"]
    assert refused_count(shoal.root) == 0


def test_a_prompt_longer_than_the_context_is_anthropic_s_400_before_any_event(
    shoal: Shoal,
) -> None:
    """What Claude Code compacts its conversation on: Anthropic's words, as a 400, not an
    error event in a 200 stream."""
    long = "hello " * (CONTEXT + 1000)
    body = {"model": MODEL, "max_tokens": 16, "stream": True}
    body["messages"] = [{"role": "user", "content": long}]
    answer = httpx.post(f"{shoal.root}/v1/messages", json=body, timeout=120)
    assert answer.status_code == 400, answer.text[:500]
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 32768 maximum", error["message"])
    chat = {"model": MODEL, "stream": True, "messages": body["messages"]}
    answer = httpx.post(f"{shoal.root}/v1/chat/completions", json=chat, timeout=120)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"
    # Each refusal is a log line with its route and reason.
    assert any("context_length_exceeded" in line for line in refusals(shoal))
