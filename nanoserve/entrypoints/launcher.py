"""vLLM's entrypoints/launcher.py: the uvicorn server the app runs in, with nanoserve's way of
ending (§3's loop keeps serving what it has accepted until it is done, or until a deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import TYPE_CHECKING

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
