"""Tool-call formats: how a model writes a call, chosen from its chat template.

- ``hermes``, for templates that contain ``<tool_call>`` (Hermes 2/3, Qwen 2.5, Qwen 3) but
  not ``<function=``: ``<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>``, one
  block per call, possibly after some text.
- ``llama3``, for templates with ``<|start_header_id|>`` and either ``<|python_tag|>`` or
  ``ipython`` (Llama 3.1, 3.2, 3.3): ``{"name": "f", "parameters": {...}}`` as the whole
  reply, or after ``<|python_tag|>``; one call per reply (Llama's templates render no more).
- ``mistral``, for templates that contain ``[TOOL_CALLS]`` (Mistral 7B v0.3, Nemo, Small):
  ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``.
- ``generic``, for any other template, and for models served with a named chat format rather
  than a template: calls as JSON only, ``{"tool_calls": [{"name": "f", "arguments": {...}}]}``
  as the whole reply; with ``auto`` the model may answer in plain text instead (a lazy grammar,
  triggered by the object's start), or, with a ``response_format``, ``{"response": ...}``.

With a native format (``hermes``, ``llama3``, ``mistral``) the tools go to the chat template, which
describes them the way the model was trained on, and the chat's earlier calls and tool results
are rendered by it. The ``generic`` format is for templates that know nothing of tools (SmolLM2's
ChatML): the tools and the JSON to answer with are described in the system message, earlier
calls are rendered as that JSON, and tool results as user messages
``{"tool_response": {"id": ..., "name": ..., "content": ...}}``. A template with ``<function=``
(Qwen3-Coder's XML calls) gets ``generic`` too, rather than JSON calls it was not trained on.

Call ids are derived from the task id and the call's index, so that a replay of the log gives
the same ids: ``call_`` and 24 hexadecimal digits, or 9 for Mistral, whose templates require ids
of exactly 9 letters and digits (ids in a chat's history that are not are mapped to 9 such
characters, the same for the call and its result).
"""

from __future__ import annotations

import hashlib
import re
from typing import Literal

ToolFormatName = Literal["hermes", "llama3", "mistral", "generic"]

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"

# What starts a Llama call, as llama.cpp's own Llama 3.x grammar allows it: an object whose
# first key is "name" (an optional "type": "function" before it), the grammar's whitespace.
_LLAMA3_CALL_START = r'\{[ \t\r\n]{0,4}(?:"type" ?: ?"function" ?, ?)?"name"'

# What starts a generic reply's calls: the object's brace, then its "tool_calls" key, with the
# whitespace the grammar's ``space`` allows between them.
_GENERIC_CALLS_START = r'\{ ?"tool_calls"'

# Lazy grammars' triggers (``Grammar.triggers``): the call's opening marker. The grammar then
# holds from the marker on, so the model may write text before a call, never a broken call.
TRIGGERS: dict[ToolFormatName, tuple[str, ...]] = {
    "hermes": (re.escape(HERMES_OPEN),),
    "mistral": (re.escape(MISTRAL_CALLS),),
    # A bare call is the whole reply (after whitespace), so it must start it; the tag may
    # come anywhere. The group is where the grammar starts.
    "llama3": (rf"^[ \t\r\n]*({_LLAMA3_CALL_START})[\s\S]*$", re.escape(PYTHON_TAG)),
    # With auto, a reply that starts with the calls' object (after whitespace); the grammar
    # starts at its brace.
    "generic": (rf"^[ \t\r\n]*({_GENERIC_CALLS_START})[\s\S]*$",),
}

_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def tool_format(chat_template: str | None) -> ToolFormatName:
    """The tool-call format a model with this chat template speaks (None: a named format,
    which knows nothing of tools)."""
    if not chat_template:
        return "generic"
    if HERMES_OPEN in chat_template:
        return "generic" if "<function=" in chat_template else "hermes"
    if MISTRAL_CALLS in chat_template:
        return "mistral"
    if "<|start_header_id|>" in chat_template and (
        PYTHON_TAG in chat_template or "ipython" in chat_template
    ):
        return "llama3"
    return "generic"


def call_id(fmt: ToolFormatName, task_id: str, index: int) -> str:
    """The id of a task's call ``index``: the same on every replay of the task."""
    digest = hashlib.sha256(f"{task_id}\x00{index}".encode()).hexdigest()
    return digest[:9] if fmt == "mistral" else f"call_{digest[:24]}"


def history_id(fmt: ToolFormatName, original: str) -> str:
    """A call id from a chat's history as the template gets it: Mistral's templates refuse
    anything but 9 letters and digits, so other ids are mapped (deterministically, the call
    and the tool message that answers it alike)."""
    if fmt != "mistral" or _MISTRAL_ID.fullmatch(original):
        return original
    return hashlib.sha256(original.encode()).hexdigest()[:9]
