"""The OpenAI-compatible HTTP server (``hayabusa serve``).

protocol.py (pydantic request models), serving.py (request -> prompt + SamplingParams -> responses and SSE
chunks), server.py (FastAPI app, auth, errors, metrics, uvicorn), cli.py (the ``serve`` subcommand).

Nothing here is imported by ``import hayabusa``: fastapi, uvicorn, pydantic and prometheus_client are the optional
``serve`` dependencies (``pip install 'hayabusa[serve]'``), imported only by server.py, serving.py and protocol.py.
"""
