"""The server's one model thread: requests take turns, a round each.

A small CPU runs one forward well and two at once no faster, so every request's work happens on one
thread, which gives each active request one round (one target forward and its drafts) in turn. Up to
`max_active` requests run interleaved; up to `max_queued` more wait for a place; beyond that a request
is turned away at once (Busy), so that a client can retry elsewhere or later instead of waiting
without end. Events go back to each request's asyncio queue on the server's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge_sd.config import GenerationConfig
from edge_sd.decoder import PREFILL_CHUNK
from edge_sd.generator import Generator
from edge_sd.model import Model


class Busy(Exception):
    """Every place is taken: the request was not queued."""


class Closing(Exception):
    """The server is shutting down: the request was cancelled."""


@dataclass
class Job:
    """One request: how to feed its generator, and where its events go. Events: ("started", prompt
    token count), ("text", str), ("done", GenerationResult), ("error", EdgeSDError or TimeoutError)."""

    config: GenerationConfig
    feed: Callable[[Generator], None]
    loop: asyncio.AbstractEventLoop
    timeout_s: float | None = None
    stream: bool = True  # whether it hears each round's text (a whole reply needs the result alone)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    gen: Generator | None = None

    def send(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def expired(self) -> bool:
        return self.timeout_s is not None and time.monotonic() - self.submitted > self.timeout_s


class Worker:
    """Runs every request's rounds on one thread, round robin (module docstring)."""

    def __init__(self, model: Model, max_active: int = 4, max_queued: int = 16):
        self.model = model
        self.max_active, self.max_queued = max_active, max_queued
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: list[Job] = []
        self._wake = threading.Condition()
        self._closed = False
        # Requests since start, by how they ended (/health shows them).
        self.ended = {"completed": 0, "cancelled": 0, "failed": 0, "refused": 0}
        self._thread = threading.Thread(target=self._run, name="edge-sd-model", daemon=True)
        self._thread.start()

    @property
    def counts(self) -> dict[str, int]:
        with self._wake:
            return {"active": len(self._active), "queued": len(self._waiting), **self.ended}

    def submit(self, job: Job) -> None:
        """Queue a request, or raise Busy where every place is taken (or the server is stopping)."""
        with self._wake:
            if self._closed or len(self._active) + len(self._waiting) >= self.max_active + self.max_queued:
                self.ended["refused"] += 1
                raise Busy()
            self._waiting.append(job)
            self._wake.notify()

    def cancel_all(self) -> None:
        """Cancel what is running or waiting: each reply ends with an error event (or a 503) at the
        thread's next turn, and new requests are refused."""
        with self._wake:
            self._closed = True
            for job in [*self._active, *self._waiting]:
                job.cancelled.set()
            self._wake.notify()

    def close(self) -> None:
        """Cancel what is still running or waiting and stop the thread."""
        self.cancel_all()
        self._thread.join(timeout=30)

    # --- the model thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._active and not self._waiting:
                    self._wake.wait()
                if self._closed and not self._active and not self._waiting:
                    return
                while self._waiting and len(self._active) < self.max_active:
                    self._active.append(self._waiting.popleft())
                turn = list(self._active)
            for job in turn:
                ended = self._round(job)
                if ended:
                    with self._wake:
                        self._active.remove(job)
                        self.ended[ended] += 1
            if self._closed:
                with self._wake:
                    for job in self._waiting:
                        job.send("error", Closing("the server is shutting down"))
                    self._waiting.clear()

    def _round(self, job: Job) -> str | None:
        """One step of a request (its start, or one round); how it ended, or None while it goes on."""
        try:
            if job.cancelled.is_set():
                if job.gen is not None:
                    job.gen.stop("cancelled")
                job.send("error", Closing("the server is shutting down"))  # heard only where the client is still there
                return "cancelled"
            if job.expired():
                if job.gen is not None:
                    job.gen.stop("timeout")
                job.send("error", TimeoutError(f"the request took longer than {job.timeout_s:g} s"))
                return "failed"
            if job.gen is None:
                gen = self.model.generator(job.config)
                gen.prefill_slice = PREFILL_CHUNK  # a long prompt is fed a chunk a turn, between the others' rounds
                job.feed(gen)
                job.gen = gen
                job.send("started", len(gen.ids))
                return None
            emitted = job.gen.generate_next_tokens()
            if emitted.text and job.stream:
                job.send("text", emitted.text)
            if job.gen.is_done:
                job.send("done", job.gen.result())
                return "completed"
            return None
        except Exception as e:  # noqa: BLE001 - one request's failure must not end the others
            job.send("error", e)
            return "failed"
