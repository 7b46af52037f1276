"""A tool and the text of a tiny tokenizer that can spell its calls, shared by the tests of chat
turns with tools (tests/test_chat_completion.py, tests/serve/test_openai_conformance.py)."""

TOOL_TEXT = 'hello {"name": "x", "city": "Paris", "ok": true} <tool_call> </tool_call> world. '
WEATHER = {"type": "function", "function": {"name": "weather", "description": "today's weather",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}}  # fmt: skip
