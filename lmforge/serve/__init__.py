"""The OpenAI-compatible HTTP server (`app.py`) and what guards it (`guards.py`).

The request limits' defaults live here, free of the web stack, so that `lmforge <verb> --help`
builds every parser on a machine without starlette/uvicorn installed."""

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024
DEFAULT_MAX_QUEUE = 64
DEFAULT_READ_TIMEOUT = 30.0
DEFAULT_KEEP_ALIVE_TIMEOUT = 5
