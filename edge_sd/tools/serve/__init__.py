"""`edge-sd serve`: an OpenAI-compatible HTTP server over one loaded Model (the `serve` extra).

app.py holds the routes, api.py the OpenAI request and reply formats, worker.py the model thread that
interleaves the requests.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

import uvicorn

from edge_sd.model import Model
from edge_sd.tools.serve.app import Server, Settings

# Seconds uvicorn waits beyond the grace before it cancels what still runs: by then the worker has
# ended every reply itself (with an error event, or a 503), which uvicorn's cancellation would not do
# (it cuts the connection and logs a traceback).
MARGIN_S = 5.0


class _Uvicorn(uvicorn.Server):
    """uvicorn, with the grace applied by the app: at the first SIGINT or SIGTERM uvicorn stops taking
    connections and waits; `grace_s` later the worker cancels what still runs."""

    def __init__(self, config: uvicorn.Config, server: Server, grace_s: float):
        super().__init__(config)
        self.server, self.grace_s = server, grace_s
        self._timer: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._timer is None and self.server.worker is not None:
            self._timer = threading.Timer(self.grace_s, self.server.worker.cancel_all)
            self._timer.daemon = True
            self._timer.start()
        super().handle_exit(sig, frame)


def run(model: Model, name: str, host: str, port: int, max_active: int, max_queued: int, timeout_s: float | None,
        api_key: str | None, grace_s: float, access_log: bool = True) -> None:
    """Serve until SIGINT or SIGTERM; requests still running grace_s later are cancelled."""
    server = Server(model, Settings(name, max_active, max_queued, timeout_s, api_key))
    logging.getLogger("edge_sd.serve").setLevel(logging.INFO)
    # uvicorn shuts down on SIGINT and SIGTERM, then raises the signal again under the handlers that
    # were there before it: handlers that do nothing make a clean shutdown exit with code 0 (the
    # default ones would end the process by the signal, or raise KeyboardInterrupt).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    config = uvicorn.Config(server.app(), host=host, port=port, timeout_graceful_shutdown=grace_s + MARGIN_S,
                            access_log=access_log, log_level="info", lifespan="on")
    _Uvicorn(config, server, grace_s).run()
