"""The server's counters in the Prometheus text format (version 0.0.4), kept by hand (no client library).

``butd_requests_total{status}`` answers by HTTP status; ``butd_request_seconds`` the latency histogram of
``POST /v1/captions``; ``butd_queue_depth`` images waiting for a batch; ``butd_batch_images`` the images per
detector/captioner batch; ``butd_images_total{outcome}`` images captioned or failed (their error entry).
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Cumulative buckets, a sum and a count (what Prometheus' ``histogram`` type exposes)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip([*map(_num, self.buckets), "+Inf"], self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        return out + [f"{name}_sum {_num(self.sum)}", f"{name}_count {self.count}"]


def _num(x: float) -> str:
    return repr(float(x))


class Metrics:
    """Thread-safe counters of one server process."""

    def __init__(self, max_batch: int) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.images: Counter[str] = Counter()
        self.latency = Histogram(LATENCY_BUCKETS)
        self.batch = Histogram(tuple(float(b) for b in sorted({1, 2, 4, 8, 16, 32, max_batch}) if b <= max_batch))
        self.queue_depth = 0

    def request(self, status: int, seconds: float | None) -> None:
        with self._lock:
            self.requests[str(status)] += 1
            if seconds is not None:
                self.latency.observe(seconds)

    def batch_done(self, images: int, captioned: int) -> None:
        with self._lock:
            self.batch.observe(float(images))
            self.images["captioned"] += captioned
            self.images["failed"] += images - captioned

    def set_queue_depth(self, n: int) -> None:
        with self._lock:
            self.queue_depth = n

    def text(self) -> str:
        with self._lock:
            out = [
                "# HELP butd_requests_total Requests answered, by HTTP status.",
                "# TYPE butd_requests_total counter",
            ]
            out += [f'butd_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())]
            out += [
                "# HELP butd_request_seconds Latency of POST /v1/captions (seconds).",
                "# TYPE butd_request_seconds histogram",
            ]
            out += self.latency.lines("butd_request_seconds")
            out += [
                "# HELP butd_queue_depth Images waiting for a batch.",
                "# TYPE butd_queue_depth gauge",
                f"butd_queue_depth {self.queue_depth}",
            ]
            out += [
                "# HELP butd_batch_images Images per detector/captioner batch.",
                "# TYPE butd_batch_images histogram",
            ]
            out += self.batch.lines("butd_batch_images")
            out += ["# HELP butd_images_total Images processed, by outcome.", "# TYPE butd_images_total counter"]
            out += [f'butd_images_total{{outcome="{k}"}} {self.images[k]}' for k in ("captioned", "failed")]
            return "\n".join(out) + "\n"
