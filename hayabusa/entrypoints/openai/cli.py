"""``hayabusa serve MODEL``: the OpenAI-compatible server (vLLM's ``vllm serve`` flags).

    hayabusa serve Qwen/Qwen2.5-0.5B-Instruct --host 127.0.0.1 --port 8000 --api-key sk-local \\
        --max-model-len 4096 --max-num-seqs 128 --gpu-memory-utilization 0.9

Every ``EngineArgs`` field is a flag (``--max-num-seqs``, ``--dtype``, ``--enable-prefix-caching`` /
``--no-enable-prefix-caching``, ...). Needs the server extra: ``pip install -e ".[serve]"``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from hayabusa.config import EngineArgs
from hayabusa.entrypoints.openai import (DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_REQUEST_BODY_TIMEOUT,
                                         DEFAULT_REQUEST_HEADER_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT,
                                         REQUEST_CHAT_TEMPLATE_TIME_LIMIT)


def _port(text: str) -> int:
    """--port's type: an integer in 0-65535 (0: the OS picks one), refused by argparse before the model loads."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (an integer in 0-65535)")
    return port


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to an argparse subparsers object; dispatch to ``run_serve(ns)``."""
    p = subparsers.add_parser("serve", allow_abbrev=False, help="run the OpenAI-compatible HTTP server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None,
                   help="HF model folder or Hub id (default: the bundled demo model stories260K)")
    p.add_argument("--model", dest="serve_model", metavar="MODEL", default=None, help="same as the positional MODEL")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port to listen on, 0-65535 (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("HAYABUSA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $HAYABUSA_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in the 'model' field and see in /v1/models (default: a Hub id as "
                        "given, a local folder's last component; MODEL as given is accepted too)")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template file (or template text) replacing the tokenizer's")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a 'chat_template' in chat requests (it runs on the server, under a "
                        f"{REQUEST_CHAT_TEMPLATE_TIME_LIMIT:g} s limit); refused with a 400 otherwise")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies get 413 (default: %(default)s = 32 MiB)")
    p.add_argument("--request-body-timeout", type=float, default=DEFAULT_REQUEST_BODY_TIMEOUT,
                   help="seconds a client has to send a request's whole body; then 408 and the connection closes "
                        "(default: %(default)s)")
    p.add_argument("--request-header-timeout", type=float, default=DEFAULT_REQUEST_HEADER_TIMEOUT,
                   help="seconds a connection has to send a request's headers (after it opens, or after its last "
                        "response); then it is closed (default: %(default)s)")
    p.add_argument("--allowed-hosts", nargs="+", default=[],
                   help="Host header names accepted besides localhost, 127.0.0.1 and ::1 ('*': any). Checked "
                        "when --host is a loopback address or this flag is given (DNS-rebinding protection)")
    p.add_argument("--allowed-origins", nargs="+", default=[],
                   help="browser origins (e.g. https://app.example.com, or '*') allowed to call the API cross-site; "
                        "CORS is off without it and requests carrying any other Origin get 403")
    p.add_argument("--public-docs-and-metrics", action="store_true",
                   help="with --api-key, serve /metrics, /docs, /redoc and /openapi.json without the key")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                   help="seconds open requests get to finish on shutdown; then each stream ends with an error "
                        "event and [DONE] (default: %(default)s)")
    p.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    EngineArgs.add_cli_args(p)
    return p


def default_served_name(model: str) -> str:
    """The name /v1/models shows without --served-model-name: a local folder's last component (its path stays
    private), a Hub id as given."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return os.path.basename(os.path.normpath(os.path.abspath(path)))
    return model


def allowed_hosts(host: str, extra: list[str]) -> list[str] | None:
    """The Host names the server accepts: loopback names (any port) plus ``extra`` when bound to loopback or
    when ``extra`` is given; None (no check) for a server bound elsewhere without ``--allowed-hosts``."""
    loopback = host in ("localhost", "::1", "[::1]") or host.startswith("127.")
    if not loopback and not extra:
        return None
    return ["localhost", "127.0.0.1", "::1", *extra]


def run_serve(ns: argparse.Namespace) -> int:
    """Start the engine and serve until interrupted. Returns the exit code (2: bad arguments or missing extras)."""
    model = ns.serve_model or ns.model_tag
    if not model:
        from hayabusa.assets import demo_model_dir

        model = demo_model_dir()
        print(f"hayabusa serve: no model given; serving the bundled demo model stories260K ({model}), a "
              "260K-parameter TinyStories Llama with a small chat template. Give MODEL (an HF folder or Hub id) "
              "for a real model.", file=sys.stderr, flush=True)
    if ns.max_request_body_bytes < 1 or not ns.shutdown_timeout >= 0:
        print("hayabusa serve: --max-request-body-bytes must be at least 1 and --shutdown-timeout at least 0, got "
              f"{ns.max_request_body_bytes} and {ns.shutdown_timeout}.", file=sys.stderr)
        return 2
    for flag, value in (("--request-body-timeout", ns.request_body_timeout),
                        ("--request-header-timeout", ns.request_header_timeout)):
        if not 0 < value < float("inf"):
            print(f"hayabusa serve: {flag} must be a positive number, got {value}.", file=sys.stderr)
            return 2
    try:
        from hayabusa.entrypoints.openai.server import build_app, run_server
    except ImportError as e:
        print(f"hayabusa serve: the server needs the 'serve' extras ({e}); run: pip install 'hayabusa[serve]'",
              file=sys.stderr)
        return 2
    from hayabusa.engine.async_llm_engine import AsyncEngineArgs, AsyncLLMEngine
    from hayabusa.entrypoints.chat_utils import load_chat_template

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    chat_template = load_chat_template(ns.chat_template)
    from hayabusa.entrypoints.media import MediaPolicy

    args = AsyncEngineArgs.from_cli_args(ns, model=model, disable_log_requests=ns.disable_log_requests)
    media_policy = MediaPolicy.from_engine_args(args)    # a bad --allowed-local-media-path fails before loading
    engine = AsyncLLMEngine.from_engine_args(args)
    names = ns.served_model_name or [default_served_name(model)]
    app = build_app(engine, names, api_key=ns.api_key, chat_template=chat_template, model_path=model,
                    trust_request_chat_template=ns.trust_request_chat_template,
                    max_request_body_bytes=ns.max_request_body_bytes, request_body_timeout=ns.request_body_timeout,
                    allowed_hosts=allowed_hosts(ns.host, ns.allowed_hosts), allowed_origins=ns.allowed_origins,
                    public_docs_and_metrics=ns.public_docs_and_metrics, media_policy=media_policy)
    print(f"hayabusa serve: {names[0]} on http://{ns.host}:{ns.port} (OpenAI API under /v1; Ctrl-C stops)",
          file=sys.stderr, flush=True)
    try:
        run_server(app, ns.host, ns.port, log_level=ns.uvicorn_log_level,
                   access_log=not ns.disable_uvicorn_access_log, shutdown_timeout=ns.shutdown_timeout,
                   header_timeout=ns.request_header_timeout)
    finally:
        engine.shutdown()
    return 0
