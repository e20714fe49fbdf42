"""vLLM's entrypoints/launcher.py: the uvicorn server the app runs in, with nanoserve's way of
ending (§3's loop keeps serving what it has accepted until it is done, or until a deadline),
where it listens (the flags' uvicorn settings); and what may wrap the app there (vLLM's
--enable-request-id-headers)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import uuid
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:  # api_server imports this module
    from nanoserve.entrypoints.api_server import Server


class UvicornServer(uvicorn.Server):
    """uvicorn's server, with nanoserve's end: when --shutdown-timeout passes, the engine
    aborts what still runs, so every handler answers (a JSON 503, or an error event and
    [DONE]) instead of uvicorn cancelling it mid-response; uvicorn's own cancel comes only
    GRACE seconds later."""

    GRACE = 5.0

    def __init__(self, config: uvicorn.Config, server: Server, timeout: float) -> None:
        super().__init__(config)
        self.app_server, self.timeout = server, timeout

    async def shutdown(self, sockets=None) -> None:
        self.app_server.draining = True
        expiry = asyncio.get_running_loop().call_later(self.timeout,
                                                       self.app_server.engine.expire)
        try:
            await super().shutdown(sockets)
        finally:
            expiry.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        """SIGINT/SIGTERM: stop accepting, let in-flight requests finish (for up to
        --shutdown-timeout); unlike uvicorn's own, no re-raise: exit 0, or 1 if any was cut."""
        old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


def request_id_headers(app: Any) -> Any:
    """vLLM's --enable-request-id-headers: every answer says X-Request-Id, the request's own
    or a new one. Plain ASGI (not a BaseHTTPMiddleware): a stream, and the disconnect that
    aborts it, pass through untouched."""
    async def with_id(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", given)]}
            await send(message)
        await app(scope, receive, send_with_id)
    return with_id


def uvicorn_config(app: Any, args: argparse.Namespace, http: Any) -> uvicorn.Config:
    """The flags' uvicorn settings (vLLM's names): a Unix socket (--uds) or --host/--port,
    HTTPS with --ssl-*, --root-path behind a proxy, the access log, the idle keep-alive and the
    graceful end's deadline; `http`: the HTTP layer with its limits (http_limits.py)."""
    return uvicorn.Config(app, host=args.host, port=args.port, uds=args.uds,
                          root_path=args.root_path, ssl_keyfile=args.ssl_keyfile,
                          ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                          ssl_cert_reqs=args.ssl_cert_reqs,
                          access_log=not args.disable_uvicorn_access_log,
                          log_level=args.uvicorn_log_level, http=http,
                          timeout_keep_alive=args.timeout_keep_alive,
                          timeout_graceful_shutdown=args.shutdown_timeout + UvicornServer.GRACE)


def address(args: argparse.Namespace) -> str:
    """Where the API is, for the start-up line."""
    if args.uds:
        return f"unix:{args.uds}"
    scheme = "https" if args.ssl_certfile else "http"
    return f"{scheme}://{args.host}:{args.port}{args.root_path}/v1"
