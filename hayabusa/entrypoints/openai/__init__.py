"""The OpenAI-compatible HTTP server (``hayabusa serve``).

protocol.py (pydantic request models, OpenAIError), request_checks.py (body size, Content-Type, JSON values; a time
limit for untrusted templates), serving.py (request -> prompt + SamplingParams -> responses and SSE chunks),
middleware.py (Host / Origin, API key, the 500 path), server.py (FastAPI app, errors, metrics, uvicorn with a
shutdown drain), cli.py (the ``serve`` subcommand and the server's defaults).

Nothing here is imported by ``import hayabusa``: fastapi, uvicorn, pydantic and prometheus_client are the optional
``serve`` dependencies (``pip install 'hayabusa[serve]'``), imported by every module here but cli.py.
"""
