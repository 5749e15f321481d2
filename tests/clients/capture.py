"""What Claude Code and Codex really send: a small server that records every request and
answers each with a canned reply of the client's dialect (a call of its shell tool when the
prompt asks for one and no tool result came back yet, else a short text), so that a client's
whole run — preflight calls, the prompt, the tool round trip — is recorded.

    python -m tests.clients.capture --out tests/clients/fixtures

runs both installed CLIs (``tests/clients/cli.py``) against it and writes each request body
as ``<client>-<n>-<what>.json``: the fixtures of ``tests/api/test_client_bodies.py``. Run it
again after changing the pinned versions (Makefile: ``CLAUDE_CODE_VERSION``,
``CODEX_VERSION``)."""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.clients.cli import CLAUDE_TOOL_PROMPT, CODEX_TOOL_PROMPT, TOOL_WORD, claude, codex

# Headers that identify the caller, not the request: not kept.
_SECRET = {"authorization", "x-api-key", "cookie"}


def sse(events: list[tuple[str | None, dict[str, Any]]]) -> bytes:
    return b"".join(
        ((f"event: {name}\n" if name else "") + f"data: {json.dumps(data)}\n\n").encode()
        for name, data in events
    )


def _texts(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _texts(v)
    elif isinstance(value, list):
        for v in value:
            yield from _texts(v)


def _wants_tool(last_user: object, answered: bool) -> bool:
    return not answered and any(TOOL_WORD in t for t in _texts(last_user))


def anthropic_reply(body: dict[str, Any]) -> tuple[str, bytes]:
    """A canned Messages reply: Bash's call, or text."""
    # The last user turn (Claude Code sends a system turn after it).
    last = [m for m in body["messages"] if m["role"] == "user"][-1]
    answered = any(
        isinstance(b, dict) and b.get("type") == "tool_result"
        for b in (last["content"] if isinstance(last["content"], list) else [])
    )
    names = [t.get("name") for t in body.get("tools") or []]
    call = "Bash" in names and _wants_tool(last, answered)
    block: dict[str, Any]
    if call:
        block = {"type": "tool_use", "id": "toolu_capture1", "name": "Bash", "input": {}}
        delta = {
            "type": "input_json_delta",
            "partial_json": json.dumps({"command": "echo shoal-capture", "description": "echo"}),
        }
    else:
        block = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": "done"}
    reason = "tool_use" if call else "end_turn"
    usage = {"input_tokens": 10, "output_tokens": 1}
    start: dict[str, Any] = {
        "id": "msg_capture",
        "type": "message",
        "role": "assistant",
        "model": body.get("model"),
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    if not body.get("stream"):
        whole = dict(block)
        if call:
            whole["input"] = json.loads(delta["partial_json"])
        else:
            whole["text"] = delta["text"]
        message = start | {"content": [whole], "stop_reason": reason}
        return "application/json", json.dumps(message).encode()
    return "text/event-stream", sse(
        [
            ("message_start", {"type": "message_start", "message": start}),
            (
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": block},
            ),
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": None},
                    "usage": usage,
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]
    )


def _shell_call(tools: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A call of Codex's shell tool, its command in the shape its schema asks."""
    for tool in tools:
        name = tool.get("name")
        if tool.get("type") != "function" or name not in ("shell", "exec_command", "shell_command"):
            continue
        props = (tool.get("parameters") or {}).get("properties") or {}
        command = props.get("command") or props.get("cmd") or {}
        key = "command" if "command" in props else "cmd"
        value: Any = ["echo", "shoal-capture"]
        if command.get("type") == "string":
            value = "echo shoal-capture"
        return {"name": name, "arguments": json.dumps({key: value})}
    return None


def responses_reply(body: dict[str, Any]) -> tuple[str, bytes]:
    """A canned Responses stream: the shell tool's call, or text."""
    given = body.get("input")
    items: list[dict[str, Any]] = given if isinstance(given, list) else []
    answered = any(i.get("type") == "function_call_output" for i in items)
    users = [i for i in items if i.get("role") == "user"]
    call = _shell_call(body.get("tools") or []) if _wants_tool(users[-1:], answered) else None
    item: dict[str, Any]
    if call is not None:
        item = {"type": "function_call", "id": "fc_capture1", "call_id": "call_capture1", **call}
        item["status"] = "completed"
    else:
        text = {"type": "output_text", "text": "done", "annotations": []}
        item = {
            "type": "message",
            "id": "msg_capture1",
            "role": "assistant",
            "status": "completed",
            "content": [text],
        }
    usage = {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 1,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 11,
    }
    response: dict[str, Any] = {
        "id": "resp_capture",
        "object": "response",
        "status": "in_progress",
        "model": body.get("model"),
        "output": [],
    }
    return "text/event-stream", sse(
        [
            ("response.created", {"type": "response.created", "response": response}),
            (
                "response.output_item.added",
                {"type": "response.output_item.added", "output_index": 0, "item": item},
            ),
            (
                "response.output_item.done",
                {"type": "response.output_item.done", "output_index": 0, "item": item},
            ),
            (
                "response.completed",
                {
                    "type": "response.completed",
                    "response": response
                    | {"status": "completed", "output": [item], "usage": usage},
                },
            ),
        ]
    )


class Recorder:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()


def handler(recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _record(self, body: Any) -> None:
            headers = {k.lower(): v for k, v in self.headers.items() if k.lower() not in _SECRET}
            with recorder.lock:
                recorder.requests.append(
                    {"method": self.command, "path": self.path, "headers": headers, "body": body}
                )

        def _send(self, status: int, kind: str, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._record(None)
            models = {"object": "list", "data": [{"id": "capture", "object": "model"}]}
            self._send(200, "application/json", json.dumps(models).encode())

        def do_HEAD(self) -> None:
            self._record(None)
            self._send(200, "text/plain", b"")

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = {"undecoded": raw.decode(errors="replace")}
            self._record(body)
            path = self.path.split("?")[0]
            if path.endswith("/count_tokens"):
                self._send(200, "application/json", b'{"input_tokens": 10}')
            elif path.endswith("/messages") and isinstance(body, dict):
                self._send(200, *anthropic_reply(body))
            elif path.endswith("/responses") and isinstance(body, dict):
                self._send(200, *responses_reply(body))
            else:
                self._send(404, "application/json", b'{"error": {"message": "not captured"}}')

    return Handler


def _name(request: dict[str, Any]) -> str:
    path: str = request["path"]
    return path.split("?")[0].strip("/").replace("/", "_")


def capture(out: Path, timeout: float) -> None:
    recorder = Recorder()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(recorder))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Callable[[], subprocess.CompletedProcess[str]]] = {
        "claude": lambda: claude(base, "capture", CLAUDE_TOOL_PROMPT, timeout),
        # A Haiku-style name thinks with a budget; its calls besides the conversation too.
        "claude-haiku": lambda: claude(base, "claude-haiku-4-5", "Hi", timeout, quiet=False),
        "codex": lambda: codex(base + "/v1", "capture", CODEX_TOOL_PROMPT, timeout),
    }
    for client, run in runs.items():
        recorder.requests.clear()
        result = run()
        print(f"{client}: exit {result.returncode}, {len(recorder.requests)} requests")
        for n, request in enumerate(recorder.requests):
            path = out / f"{client}-{n:02d}-{_name(request)}.json"
            path.write_text(json.dumps(request, indent=1, ensure_ascii=False) + "\n")
    server.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "fixtures")
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    capture(args.out, args.timeout)


if __name__ == "__main__":
    main()
