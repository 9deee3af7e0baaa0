"""Dynamic batching: the images of concurrent requests share detector and captioner batches.

One model thread owns the captioning engine (:class:`pipeline.captioning.engine.PhotoCaptioner`, the engine of
``cli caption``). A request's images are first admitted, then decoded off the model thread by a small pool of
``serve.decode_threads`` threads (:meth:`~pipeline.captioning.engine.PhotoCaptioner.photo_dataset`: ``caption``'s
photo path, :mod:`extractors.photos`, with its pixel cap, thin-image check and failure reasons), then queued
(:meth:`Batcher.submit`). The model thread takes the oldest image, waits at most ``max_wait`` for others to join
it, and runs up to ``max_batch`` images with the same decoding options through
:meth:`~pipeline.captioning.engine.PhotoCaptioner.caption_decoded` as one batch: detection, captioning and the
per-image guard (a bad image is an error entry, the others of its batch are captioned) are exactly
``caption``'s. Images with other options wait for a later batch, in order.

Bounds: at most ``queue_limit`` images are admitted (being decoded, waiting or in a batch); a request that does not fit
is refused whole (:class:`QueueFull`, HTTP 503 with Retry-After) before any of its images is decoded. Images of a
request that gave up (timeout, client gone) are dropped when their turn comes. On SIGTERM :meth:`Batcher.flush` sends
what waits at once; :meth:`Batcher.close` stops admitting and returns once everything admitted has been answered.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.core.console import get_logger
from pipeline.core.errors import exception_line
from pipeline.serving.metrics import Metrics

log = get_logger("serve")


class QueueFull(Exception):
    """The request's images do not fit in the queue (HTTP 503)."""


class Closed(Exception):
    """The server is draining and admits nothing new (HTTP 503)."""


@dataclass
class Job:
    """One decoded image waiting for a batch (an :class:`extractors.photos.Photo`); its result (a
    ``CaptionResult``) is set on ``future`` in the event loop."""

    photo: Any
    group: tuple[Any, bool]  # (DecodeOptions, relevance): only images of one group share a batch
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    dropped: bool = False
    queued_at: float = field(default_factory=time.monotonic)


class Batcher:
    """The model thread and its bounded queue (see the module docstring)."""

    def __init__(
        self,
        engine: Any,
        max_batch: int,
        max_wait_s: float,
        queue_limit: int,
        metrics: Metrics,
        decode_threads: int = 2,
    ) -> None:
        self.engine, self.max_batch, self.max_wait_s, self.queue_limit = (
            engine,
            int(max_batch),
            float(max_wait_s),
            int(queue_limit),
        )
        self.metrics = metrics
        self._decoders = ThreadPoolExecutor(max(1, int(decode_threads)), thread_name_prefix="serve-decode")
        self._cv = threading.Condition()
        self._queue: deque[Job] = deque()
        self._admitted = 0
        self._decoding: dict[int, tuple[float, Any]] = {}  # requests being decoded: (admitted at, group)
        self._requests = 0
        self._closing = self._flushing = False
        self._engines: dict[Any, Any] = {}
        self._thread = threading.Thread(target=self._run, name="serve-batcher", daemon=True)
        self._thread.start()

    # -- the request side (event loop) ---------------------------------------------------------------
    async def submit(self, items: Sequence[Any], options: Any, relevance: bool) -> list[Job]:
        """Admit ``items`` as one request (refused whole when the server drains or they do not fit), decode them
        in the decoding threads, and queue them for the model thread."""
        loop = asyncio.get_running_loop()
        with self._cv:
            if self._closing:
                raise Closed("the server is shutting down")
            if self._admitted + len(items) > self.queue_limit:
                raise QueueFull(
                    f"{self._admitted} images admitted, {len(items)} more would pass the queue limit of "
                    f"{self.queue_limit}"
                )
            self._admitted += len(items)
            self._requests += 1
            ticket = self._requests
            self._decoding[ticket] = (time.monotonic(), (options, bool(relevance)))
        try:
            dataset = self.engine.photo_dataset(items)
            photos = await asyncio.gather(
                *(loop.run_in_executor(self._decoders, dataset.__getitem__, i) for i in range(len(items)))
            )
        except BaseException:  # cancelled (client gone, timeout) or an unexpected decoding error: give the places back
            with self._cv:
                self._admitted -= len(items)
                del self._decoding[ticket]
                self._cv.notify_all()
            raise
        with self._cv:
            del self._decoding[ticket]
            jobs = [Job(p, (options, bool(relevance)), loop.create_future(), loop) for p in photos]
            self._queue.extend(jobs)
            self.metrics.set_queue_depth(len(self._queue))
            self._cv.notify()
        return jobs

    @staticmethod
    def drop(jobs: Sequence[Job]) -> None:
        """The request gave up: its images still waiting are not captioned."""
        for j in jobs:
            j.dropped = True

    @property
    def depth(self) -> int:
        with self._cv:
            return len(self._queue)

    def flush(self) -> None:
        """Stop waiting for company (draining): what is queued goes now; admission goes on until :meth:`close`."""
        with self._cv:
            self._flushing = True
            self._cv.notify_all()

    def close(self, timeout: float | None = None) -> bool:
        """Admit nothing more, let the thread finish what was admitted; True when it has."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout)
        self._decoders.shutdown(wait=False, cancel_futures=True)
        return not self._thread.is_alive()

    # -- the model thread ------------------------------------------------------------------------------
    def _take(self) -> list[Job] | None:
        """The next batch: the oldest image's group, up to ``max_batch``, after at most ``max_wait``; images of
        that group admitted before the oldest one was queued and still being decoded are waited for (their
        decoding is short and bounded: the batch they belong to is not split by decoding times)."""
        with self._cv:
            while not self._queue:
                if self._closing and self._admitted == 0:  # nothing queued and nothing being decoded
                    return None
                self._cv.wait()
            first = self._queue[0]
            deadline = first.queued_at + self.max_wait_s
            while (
                not (self._closing or self._flushing)
                and sum(j.group == first.group for j in self._queue) < self.max_batch
            ):
                left = deadline - time.monotonic()
                older = any(g == first.group and t <= first.queued_at for t, g in self._decoding.values())
                if left <= 0 and not older:
                    break
                self._cv.wait(left if left > 0 else 0.05)  # woken when an image is queued
            batch, rest = [], deque()
            for j in self._queue:
                (batch if j.group == first.group and len(batch) < self.max_batch else rest).append(j)
            self._queue = rest
            self.metrics.set_queue_depth(len(rest))
            return batch

    def _engine_for(self, options: Any) -> Any:
        """The engine with these decoding options: a shallow copy sharing the loaded models."""
        if options == self.engine.options:
            return self.engine
        if options not in self._engines:
            twin = copy.copy(self.engine)
            twin.options = options
            self._engines[options] = twin
        return self._engines[options]

    def _run(self) -> None:
        # the engine applies caption.precision itself, in this thread (autocast is per thread)
        with torch.inference_mode(False):
            while (batch := self._take()) is not None:
                try:
                    live = [j for j in batch if not j.dropped]
                    if live:
                        self._caption(live)
                finally:
                    with self._cv:
                        self._admitted -= len(batch)

    def _caption(self, jobs: list[Job]) -> None:
        options, relevance = jobs[0].group
        try:
            engine = self._engine_for(options)
            results = engine.caption_decoded([j.photo for j in jobs], relevance=relevance)
        except Exception as exc:  # noqa: BLE001 - a project error (e.g. feature size) fails these requests, not the server
            log.error("batch of %d images failed: %s", len(jobs), exception_line(exc))
            for j in jobs:
                j.loop.call_soon_threadsafe(_fail, j.future, exc)
            return
        self.metrics.batch_done(len(jobs), sum(r.error is None for r in results))
        for j, r in zip(jobs, results):
            j.loop.call_soon_threadsafe(_resolve, j.future, r)


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
