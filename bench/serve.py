"""Load test of ``cli serve``: N concurrent clients on loopback for a fixed time with real photos, beside the
throughput of the same captioning engine run in one process the way ``caption`` runs it.

    python -m bench.serve --model runs/demo --photos my_photos/ [--clients 4] [--seconds 30] [--images-per-request 1]
                          [--batch-size 8] [--max-wait-ms 20] [--queue-limit N] [--regions] [--set KEY=VALUE ...]
                          [--json FILE]

1. ``caption`` in one process: the engine that ``caption`` builds (``configs/caption.yaml`` with the ``--set``
   overrides: its batch size and decoding workers), captioning the photos round after round for ``--seconds``
   after one untimed round; images per second.
2. ``serve``: the server in a child process on a free 127.0.0.1 port (``configs/serve.yaml`` with the same
   overrides), one untimed request per photo, then ``--clients`` threads each posting ``--images-per-request``
   photos at a time (round robin) for ``--seconds``, every request bounded by a timeout. Prints throughput (images
   per second answered 200), latency p50/p95/p99, answers by status (no answer and 500 counted apart), the
   server's peak RSS (VmHWM) and the ratio to (1). A client told 503 waits its Retry-After before the next request.
   Captions the server gave are compared with (1)'s per photo.

Only 127.0.0.1 is contacted; the server is stopped with SIGTERM (and killed by its pid if it hangs).
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from extractors.inputs import items_from_paths
from pipeline.captioning.choose import find_checkpoint, find_detector
from pipeline.captioning.run import build_engine
from pipeline.core import threads as thread_policy
from pipeline.core.config import load_config

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("bench.serve")


def multipart(files: list[tuple[str, bytes]], fields: dict[str, Any]) -> tuple[bytes, str]:
    """A multipart/form-data body with ``files`` (as ``files`` parts) and text ``fields``."""
    boundary = uuid.uuid4().hex
    out = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields.items()
    ]
    out += [
        f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{n}"\r\n'
        f"Content-Type: application/octet-stream\r\n\r\n".encode()
        + data
        + b"\r\n"
        for n, data in files
    ]
    return b"".join(out) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def start_server(args: list[str], timeout: float = 300) -> tuple[subprocess.Popen, int]:
    """``cli.py serve --port 0 ARGS`` in a child process; its port once ``/healthz`` answers."""
    env = dict(os.environ, BUTD_NO_PROGRESS="1")
    errors = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "cli.py"), "serve", "--port", "0", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
    )
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline()  # the first line names the port (or the process ended)
    if not line.startswith("serving on http://127.0.0.1:"):
        proc.kill()
        proc.wait()
        errors.seek(0)
        raise RuntimeError(f"the server did not start: {errors.read().strip()[-2000:]}")
    port = int(line.split("127.0.0.1:", 1)[1].split()[0])
    while time.monotonic() < deadline:
        try:
            if request(port, "GET", "/healthz")[0] == 200:
                return proc, port
        except OSError:
            time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError("the server never answered /healthz")


def stop_server(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(10)


def request(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 300,
    conn: http.client.HTTPConnection | None = None,
    answer: dict | None = None,
) -> tuple[int, bytes]:
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        res = conn.getresponse()
        if answer is not None:
            answer["retry_after"] = res.getheader("Retry-After")
        return res.status, res.read()
    finally:
        if own:
            conn.close()


def metric(text: str, name: str) -> float:
    """A sample of the Prometheus text (0 when absent)."""
    parts = text.split(f"\n{name} ", 1)
    return float(parts[1].split()[0]) if len(parts) == 2 else 0.0


def peak_rss_mb(pid: int) -> float:
    """VmHWM (peak resident set) of a live process, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def baseline(model: str, weights: str | None, photos: Path, sets: list[str], seconds: float) -> dict[str, Any]:
    """``caption``'s engine in this process: images per second over whole rounds of the photos."""
    thread_policy.prepare_process(None)
    thread_policy.apply()
    cfg = load_config("caption", None, sets).caption
    ckpt = find_checkpoint(Path(model), None)
    engine = build_engine(ckpt, find_detector(Path(model), ckpt, weights), cfg)[0]
    items = items_from_paths([str(photos)])
    captions = {
        r.path.name: r.caption for r in engine.caption_paths(items, int(cfg.batch_size), workers=int(cfg.num_workers))
    }
    rounds, start = 0, time.perf_counter()
    while rounds == 0 or time.perf_counter() - start < seconds:
        for _ in engine.caption_paths(items, int(cfg.batch_size), workers=int(cfg.num_workers)):
            pass
        rounds += 1
    wall = time.perf_counter() - start
    return {
        "images_per_s": rounds * len(items) / wall,
        "rounds": rounds,
        "seconds": wall,
        "images": len(items),
        "batch_size": int(cfg.batch_size),
        "num_workers": int(cfg.num_workers),
        "captions": captions,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def load(
    port: int, photos: list[Path], clients: int, seconds: float, per_request: int, regions: bool
) -> dict[str, Any]:
    """``clients`` threads posting for ``seconds``; latencies and answers by status."""
    data = [(p.name, p.read_bytes()) for p in photos]
    fields = {"regions": "true" if regions else "false"}
    lock = threading.Lock()
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    captions: dict[str, set[str]] = {}
    counter = [0]
    deadline = time.monotonic() + seconds

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=max(60.0, seconds))
        while time.monotonic() < deadline:
            with lock:
                start = counter[0]
                counter[0] += per_request
            files = [data[(start + k) % len(data)] for k in range(per_request)]
            body, ctype = multipart(files, fields)
            t0 = time.perf_counter()
            head: dict[str, Any] = {}
            try:
                status, raw = request(
                    port, "POST", "/v1/captions", body, {"Content-Type": ctype}, conn=conn, answer=head
                )
            except (OSError, http.client.HTTPException):
                status, raw = 0, b""
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=max(60.0, seconds))
            took = time.perf_counter() - t0
            with lock:
                key = str(status) if status else "no answer"
                statuses[key] = statuses.get(key, 0) + 1
                if status == 200:
                    latencies.append(took)
                    for a in json.loads(raw)["images"]:
                        captions.setdefault(a["name"], set()).add(a.get("caption", a.get("error", "")))
            if status == 503:  # overloaded: wait as told (a well-behaved client), within the run's time
                time.sleep(max(0.0, min(float(head.get("retry_after") or 1), deadline - time.monotonic())))
        conn.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 600)
    wall = time.perf_counter() - t0
    lat = sorted(latencies)

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000 if lat else float("nan")

    return {
        "images_per_s": len(lat) * per_request / wall,
        "requests_per_s": len(lat) / wall,
        "seconds": wall,
        "p50_ms": pct(0.50),
        "p95_ms": pct(0.95),
        "p99_ms": pct(0.99),
        "statuses": statuses,
        "captions": captions,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="captioner checkpoint or run folder (as for `caption`)")
    ap.add_argument("--weights", default=None, help="detector weights (default: the run's)")
    ap.add_argument("--photos", type=Path, required=True, help="folder of photos")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument(
        "--seconds", type=float, default=30.0, help="load time, and the least time of the in-process rounds"
    )
    ap.add_argument("--images-per-request", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=8, help="the server's max batch (serve.max_batch)")
    ap.add_argument("--max-wait-ms", type=float, default=20.0)
    ap.add_argument(
        "--queue-limit",
        type=int,
        default=None,
        help="serve.queue_limit (default: room for every client; smaller shows 503s)",
    )
    ap.add_argument(
        "--regions",
        action="store_true",
        help="ask the server for regions (occlusion relevance: more work than caption)",
    )
    ap.add_argument(
        "--set", dest="sets", action="append", default=[], help="caption.KEY=VALUE for both sides (repeatable)"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    photos = sorted(p for p in args.photos.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp", ".bmp"))
    if not photos:
        sys.stderr.write(f"error: no photos in {args.photos}\n")
        return 2
    load0 = os.getloadavg()[0]
    log.info("caption in one process: %d photos, rounds for at least %.0f s", len(photos), args.seconds)
    base = baseline(args.model, args.weights, args.photos, args.sets, args.seconds)
    server_args = [
        "--model",
        args.model,
        *(["--weights", args.weights] if args.weights else []),
        "--batch-size",
        str(args.batch_size),
        "--set",
        f"serve.max_wait_ms={args.max_wait_ms:g}",
        "--set",
        f"serve.queue_limit={args.queue_limit or max(64, 4 * args.clients * args.images_per_request)}",
        *[x for s in args.sets for x in ("--set", s)],
        "--quiet",
    ]
    proc, port = start_server(server_args)
    try:
        warm: dict[str, set[str]] = {}
        for name, data in ((p.name, p.read_bytes()) for p in photos):  # warm-up: one request per photo
            body, ctype = multipart([(name, data)], {"regions": "false"})
            status, raw = request(port, "POST", "/v1/captions", body, {"Content-Type": ctype})
            for a in json.loads(raw)["images"] if status == 200 else []:
                warm.setdefault(a["name"], set()).add(a.get("caption", a.get("error", "")))
        before = request(port, "GET", "/metrics")[1].decode()
        log.info(
            "serve: %d clients, %d image(s) per request, %.0f s", args.clients, args.images_per_request, args.seconds
        )
        served = load(port, photos, args.clients, args.seconds, args.images_per_request, args.regions)
        served["peak_rss_mb"] = peak_rss_mb(proc.pid)
        metrics = request(port, "GET", "/metrics")[1].decode()
        for name, caps in warm.items():
            served["captions"].setdefault(name, set()).update(caps)
    finally:
        code = stop_server(proc)
    load1 = os.getloadavg()[0]
    same = sum(served["captions"].get(n) == {c} for n, c in base["captions"].items())
    mean_batch = (metric(metrics, "butd_batch_images_sum") - metric(before, "butd_batch_images_sum")) / max(
        1.0, metric(metrics, "butd_batch_images_count") - metric(before, "butd_batch_images_count")
    )
    result = {
        "cores": len(os.sched_getaffinity(0)),
        "load_average": [load0, load1],
        "photos": len(photos),
        "clients": args.clients,
        "images_per_request": args.images_per_request,
        "server_max_batch": args.batch_size,
        "max_wait_ms": args.max_wait_ms,
        "regions": args.regions,
        "caption": {k: v for k, v in base.items() if k != "captions"},
        "serve": {k: v for k, v in served.items() if k != "captions"},
        "mean_batch": mean_batch,
        "ratio": served["images_per_s"] / base["images_per_s"],
        "captions_equal": f"{same}/{len(base['captions'])}",
        "server_exit": code,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    s = served
    print(
        f"caption, one process : {base['images_per_s']:.2f} images/s ({base['rounds']} rounds of {base['images']} "
        "photos in "
        f"{base['seconds']:.1f} s, batch {base['batch_size']}, {base['num_workers']} decoding workers; peak RSS "
        f"{base['peak_rss_mb']:.0f} MB)"
    )
    print(
        f"serve, {args.clients} clients    : {s['images_per_s']:.2f} images/s, {s['requests_per_s']:.2f} requests/s, "
        "latency p50 "
        f"{s['p50_ms']:.0f} ms / p95 {s['p95_ms']:.0f} ms / p99 {s['p99_ms']:.0f} ms; answers {s['statuses']}; mean "
        "batch "
        f"{mean_batch:.2f} images; server peak RSS {s['peak_rss_mb']:.0f} MB"
    )
    print(
        f"ratio serve / caption: x{result['ratio']:.2f}; captions equal for {result['captions_equal']} photos; server "
        f"exit {code}; "
        f"load average {load0:.1f} -> {load1:.1f} on {result['cores']} cores"
    )
    bad = {k: v for k, v in s["statuses"].items() if k not in ("200", "503")}
    if bad or code != 0 or same != len(base["captions"]):
        sys.stderr.write(
            f"error: answers {bad or 'ok'}, server exit {code}, captions equal {result['captions_equal']}\n"
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
