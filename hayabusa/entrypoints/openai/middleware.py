"""Pure ASGI middlewares of the server (they never wrap ``receive``, so a client's disconnect still reaches the
handlers): the Host / Origin check, the API key, and the one place an unexpected exception becomes a 500.

Why the Host / Origin check: a server bound to loopback with no key is reachable from any web page the user opens.
A page can send a "simple" cross-site POST (refused by the Content-Type check, see request_checks.py) and, by DNS
rebinding (its own name resolving to 127.0.0.1), even read the answers; the Host header then carries the page's
name, which is not on the allow list. A browser's cross-site request also carries its ``Origin``, which must be
the server itself or one of ``--allowed-origins``.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any, Iterable
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse

from hayabusa.entrypoints.openai.protocol import error_body

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# Besides /v1: the routes that need the key when one is set, unless they are made public (--public-docs-and-metrics).
KEYED_NON_V1_PATHS = ("/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


def _header(scope: dict, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


def host_name(host_header: str) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1``; lower case."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


async def _reply(scope: dict, receive: Any, send: Any, status: int, message: str, type: str, code: str) -> None:
    await JSONResponse(error_body(message, type, None, code), status_code=status)(scope, receive, send)


class HostOriginMiddleware:
    """400 for a Host header not on ``allowed_hosts`` (None: any host); 403 for an ``Origin`` that is neither the
    server itself (same host and port as the Host header) nor in ``allowed_origins`` ("*": any)."""

    def __init__(self, app: Any, allowed_hosts: Iterable[str] | None, allowed_origins: Iterable[str] = ()) -> None:
        self.app = app
        self.allowed_hosts = None if allowed_hosts is None else {host_name(h) for h in allowed_hosts}
        self.any_host = self.allowed_hosts is not None and "*" in self.allowed_hosts
        self.allowed_origins = {o.rstrip("/").lower() for o in allowed_origins}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = _header(scope, b"host") or ""
        if self.allowed_hosts is not None and not self.any_host and host_name(host) not in self.allowed_hosts:
            return await _reply(scope, receive, send, 400, f"Host {host!r} is not allowed (start the server with "
                                "--allowed-hosts to allow it).", "invalid_request_error", "invalid_host")
        origin = _header(scope, b"origin")
        if origin is not None and not self._origin_ok(origin, host):
            return await _reply(scope, receive, send, 403, f"Origin {origin!r} is not allowed (start the server with "
                                "--allowed-origins to allow it).", "permission_error", "invalid_origin")
        return await self.app(scope, receive, send)

    def _origin_ok(self, origin: str, host: str) -> bool:
        o = origin.rstrip("/").lower()
        if "*" in self.allowed_origins or o in self.allowed_origins:
            return True
        try:
            return urlsplit(o).netloc == host.strip().lower() != ""
        except ValueError:
            return False


class APIKeyMiddleware:
    """401 without ``Authorization: Bearer <key>`` on /v1 routes and (unless ``public_paths``) on /metrics, /docs,
    /redoc and /openapi.json. /health and /version stay open (load balancers probe them)."""

    def __init__(self, app: Any, api_key: str, public_docs_and_metrics: bool = False) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.keyed_paths = () if public_docs_and_metrics else KEYED_NON_V1_PATHS

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not (
                path.startswith("/v1") or path in self.keyed_paths):
            return await self.app(scope, receive, send)
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = auth.partition(b" ")
        # The scheme is case-insensitive (RFC 7235: "bearer", "BEARER"); the key is compared in constant time.
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(b" "), self.expected):
            return await self.app(scope, receive, send)
        msg = "Incorrect API key provided." if auth else "Missing API key: send 'Authorization: Bearer <key>'."
        await _reply(scope, receive, send, 401, msg, "authentication_error", "invalid_api_key")


class InternalErrorMiddleware:
    """An exception no handler turned into a response: one log line with its traceback, and a 500 in OpenAI's shape
    on a connection that stays open (Starlette's own last resort re-raises to the server, which logs the traceback
    a second time and drops the keep-alive connection)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        except Exception as e:  # noqa: BLE001 -- the last resort: answer, log once
            logger.error("internal error in %s %s", scope.get("method"), ascii(scope.get("path")), exc_info=e)
            try:
                await _reply(scope, receive, send, 500, f"Internal server error: {type(e).__name__}",
                             "internal_server_error", None)
            except RuntimeError:        # the response had already started: the server ends the connection
                pass
