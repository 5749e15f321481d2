"""Tool calling and structured output, independent of the engine: from a chat task and the
model's chat template, the chat to render (``messages``), the grammar the reply must follow
and a parser that reads the reply back into content and tool calls as it streams.

``formats`` says which tool-call format a template speaks, ``schema`` (and ``pattern``)
which JSON schemas can be honoured, ``grammar`` builds the GBNF grammars, ``messages`` the
chat, ``parsers`` reads replies (a character at a time, with ``text_reader``) and ``plan``
puts them together. Only ``grammar`` needs
llama.cpp, and it imports it when it first builds one.
"""

from structured.formats import ToolFormatName, tool_format
from structured.plan import ReplyPlan, plan_reply
from structured.schema_checks import schema_problem

__all__ = ["ReplyPlan", "ToolFormatName", "plan_reply", "schema_problem", "tool_format"]
