"""What the SDK tests ask the session's model, whatever the dialect's words for it."""

from __future__ import annotations

from typing import Any

WEATHER_NAME = "get_weather"
WEATHER_DESCRIPTION = "The current weather in a city."
WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "The city's name."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_QUESTION = "What is the weather like in Paris today?"
HELLO = "Say hello in one short sentence."
