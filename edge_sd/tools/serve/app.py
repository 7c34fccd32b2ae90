"""The HTTP side of `edge-sd serve`: Starlette routes over the model thread (worker.py), run by uvicorn.

Every request is checked before it is queued (api.py), so bad input is answered at once with an
OpenAI-style error object and never reaches the model. A streamed reply's status line is sent once
its prompt has been fed, so that a prompt beyond the context is a 400 like any other bad input. A
client that goes away, streaming or not, has its request cancelled at the model thread's next turn.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edge_sd import __version__
from edge_sd.errors import ContextLimitError, UsageError
from edge_sd.model import Model
from edge_sd.tools.serve import api
from edge_sd.tools.serve.worker import Busy, Closing, Job, Worker

log = logging.getLogger("edge_sd.serve")
MAX_BODY = 4 << 20  # bytes: a request body larger than this is refused before it is read
RETRY_AFTER_S = 1


@dataclass
class Settings:
    name: str  # the model's id in /v1/models and in replies
    max_active: int = 4
    max_queued: int = 16
    timeout_s: float | None = None
    api_key: str | None = None


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(api.error_body(message, kind, param, code), status_code=status, headers=headers)


def _error_of(e: BaseException, chat: bool) -> JSONResponse:
    """The reply to a request the model thread refused or could not finish."""
    if isinstance(e, api.RequestError):
        return _error(e.status, str(e), param=e.field, code=e.code)
    if isinstance(e, ContextLimitError):
        return _error(400, str(e), param="messages" if chat else "prompt", code="context_length_exceeded")
    if isinstance(e, UsageError):
        return _error(400, str(e), param=e.field)
    if isinstance(e, TimeoutError):
        return _error(504, str(e), kind="timeout_error")
    if isinstance(e, Closing):
        return _error(503, str(e), kind="server_error", headers={"Retry-After": str(RETRY_AFTER_S)})
    log.error("request failed", exc_info=e)  # a fault of the server's, not of the request: its traceback helps
    return _error(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _gone(request: Request) -> None:
    """Returns when the client disconnects (its body has been read: nothing else comes but that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next_event(request: Request, job: Job) -> tuple[str, Any] | None:
    """The job's next event, or None when the client went away first."""
    event = asyncio.ensure_future(job.events.get())
    gone = asyncio.ensure_future(_gone(request))
    try:
        await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if event.done():
        return event.result()
    event.cancel()
    return None


class Server:
    """The routes, bound to one model and its worker."""

    def __init__(self, model: Model, settings: Settings):
        self.model, self.settings = model, settings
        self.worker: Worker | None = None
        self.fingerprint = f"edge-sd-{__version__}"

    def app(self) -> Starlette:
        @asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            self.worker = Worker(self.model, self.settings.max_active, self.settings.max_queued)
            try:
                yield
            finally:
                self.worker.close()  # after uvicorn's grace: what still runs is cancelled

        routes = [Route("/health", self.health), Route("/v1/models", self.models),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"])]
        return Starlette(routes=routes, lifespan=lifespan,
                         exception_handlers={HTTPException: self._http_error, Exception: self._internal})

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    async def _internal(self, request: Request, exc: Exception) -> Response:
        return _error_of(exc, chat=False)

    def _refused(self, request: Request) -> JSONResponse | None:
        key = self.settings.api_key
        if key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return _error(401, "a valid API key is needed (Authorization: Bearer KEY)", kind="authentication_error",
                              code="invalid_api_key")
        return None

    async def health(self, request: Request) -> Response:
        counts = self.worker.counts if self.worker is not None else {}
        return JSONResponse({"status": "ok", **counts})

    async def models(self, request: Request) -> Response:
        if (refusal := self._refused(request)) is not None:
            return refusal
        return JSONResponse({"object": "list", "data": [{"id": self.settings.name, "object": "model",
                                                         "created": int(time.time()), "owned_by": "edge-sd"}]})

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _body(self, request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY:
            raise api.RequestError(f"the request body is {length} bytes; at most {MAX_BODY}", status=413)
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise api.RequestError(f"the request body is {len(raw)} bytes; at most {MAX_BODY}", status=413)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise api.RequestError(f"the request body is not valid JSON: {e}") from None

    async def _complete(self, request: Request, chat: bool) -> Response:
        if (refusal := self._refused(request)) is not None:
            return refusal
        try:
            req = api.parse(await self._body(request), chat, self.model.target.manifest.max_context)
        except api.RequestError as e:
            return _error_of(e, chat)
        job = Job(req.config, req.feed, asyncio.get_running_loop(), self.settings.timeout_s, req.stream)
        assert self.worker is not None
        try:
            self.worker.submit(job)
        except Busy:
            return _error(503, "the server is busy: every place is taken; retry later", kind="server_error",
                          code="busy", headers={"Retry-After": str(RETRY_AFTER_S)})
        reply = api.Reply(chat, self.settings.name, self.fingerprint)
        try:
            first = await _next_event(request, job)
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        if first is None:
            job.cancelled.set()
            return Response(status_code=499)  # nobody reads it: the client has gone
        kind, value = first
        if kind != "started":
            return _error_of(value, chat)
        reply.prompt_tokens = value
        if req.stream:
            return StreamingResponse(self._stream(job, reply, req.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(request, job, reply, chat)

    async def _whole(self, request: Request, job: Job, reply: api.Reply, chat: bool) -> Response:
        try:
            while True:
                event = await _next_event(request, job)
                if event is None:
                    return Response(status_code=499)
                kind, value = event
                if kind == "done":
                    return JSONResponse(reply.whole(value))
                if kind == "error":
                    return _error_of(value, chat)
        finally:
            job.cancelled.set()  # ended, failed or abandoned: the model thread lets it go

    async def _stream(self, job: Job, reply: api.Reply, include_usage: bool) -> AsyncIterator[str]:
        try:
            if reply.chat:
                yield _sse(reply.chunk(first=True))
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    yield _sse(reply.chunk(value))
                elif kind == "done":
                    yield _sse(reply.last_chunk(value))
                    if include_usage:
                        yield _sse(reply.usage_chunk(value))
                    yield "data: [DONE]\n\n"
                    return
                elif kind == "error":
                    response = _error_of(value, reply.chat)
                    yield _sse(json.loads(bytes(response.body)))
                    return
        finally:
            job.cancelled.set()  # the reply ended, or the client went away mid-stream
