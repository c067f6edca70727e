"""The OpenAI-compatible HTTP server (``hayabusa serve``).

protocol.py (pydantic request models, OpenAIError), request_checks.py (body size, Content-Type, JSON values; a time
limit for untrusted templates), serving.py (request -> prompt + SamplingParams -> responses and SSE chunks),
middleware.py (Host / Origin, API key, the 500 path), server.py (FastAPI app, errors, metrics, uvicorn with a
shutdown drain), cli.py (the ``serve`` subcommand). The server's defaults are here, where cli.py (which imports no serve extra)
and the server modules both read them.

Nothing here is imported by ``import hayabusa``: fastapi, uvicorn, pydantic and prometheus_client are the optional
``serve`` dependencies (``pip install 'hayabusa[serve]'``), imported by every module here but cli.py.
"""

# Server defaults (the flags of cli.py and the keyword defaults of server.py / serving.py).
# 32 MiB: a full 128k-token context is about 1 MB of text or token ids, so this leaves room for many prompts in one
# request while bounding what one client can make the server hold.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_SHUTDOWN_TIMEOUT = 10.0            # seconds of drain on shutdown
# Seconds a client has to send a whole request body, once its headers are in; then 408 and the connection closes
# (a client that announces a Content-Length and never sends it would otherwise hold its connection forever).
DEFAULT_REQUEST_BODY_TIMEOUT = 30.0
# Seconds a connection has to send a whole request head (request line and headers), from when it opens or its last
# response ended; then it is closed. uvicorn has no such limit: connections that send a few header bytes (or
# nothing) were held forever, and enough of them use up the server's file descriptors (slowloris).
DEFAULT_REQUEST_HEADER_TIMEOUT = 30.0
REQUEST_CHAT_TEMPLATE_TIME_LIMIT = 5.0     # seconds a request's own chat template may take to render
