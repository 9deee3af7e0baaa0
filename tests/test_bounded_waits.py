"""Every wait on DataLoader workers is bounded: a worker that cannot hand its photos over through shared memory
(/dev/shm full, simulated by making torch's shared-memory calls raise the error a full /dev/shm raises), a worker
that dies and a worker that hangs never leave the photo loop (extract, eval-detector, caption) waiting: every
photo still comes back, in order, and one line says why and what to do (--ipc=host, --shm-size, --num-workers 0).

Each case runs in a child process with a deadline, so a loop that would wait forever fails the test instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, signal, sys, time
from pathlib import Path
import torch
from torch.utils.data import get_worker_info
from extractors.inputs import items_from_paths
from extractors import photos as P

mode, folder = sys.argv[1], sys.argv[2]
paths = sorted(str(p) for p in Path(folder).glob("*.png"))
if mode == "shm":
    def full(self, *a, **k):
        raise RuntimeError("unable to write to file </torch_4242_1234567_0>: No space left on device (28)")
    torch.UntypedStorage._share_fd_cpu_ = full
    torch.UntypedStorage._share_filename_cpu_ = full
else:
    plain = P.PhotoDataset.__getitem__
    def odd(self, i):
        if get_worker_info() is not None and i == 3:
            if mode == "dies":
                os.kill(os.getpid(), signal.SIGBUS)
            time.sleep(3600)  # hangs
        return plain(self, i)
    P.PhotoDataset.__getitem__ = odd
items = items_from_paths(paths)
ds = P.PhotoDataset(items, None, 10**8, 16, [P.Need.IMAGE] * len(items), keep_images=True)
got = []
for batch in P.photo_batches(ds, 2, 2):
    got += [(p.index, None if p.image is None else list(p.image.shape), p.failure and p.failure.line) for p in batch]
print(json.dumps(got))
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("photos")
    for i in range(8):
        Image.new("RGB", (40 + i, 30), (10 * i, 20, 30)).save(d / f"{i}.png")
    return d


@pytest.mark.parametrize("mode", ["shm", "dies", "hangs"])
def test_photo_workers_never_leave_the_loop_waiting(folder: Path, mode: str) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "BUTD_NO_PROGRESS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "BUTD_WORKER_WAIT": "8",
        "COLUMNS": "400",
    }
    try:
        res = subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(folder)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=150,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{mode}: the photo loop was still waiting on its workers after 150 s")
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert [g[0] for g in got] == list(range(8))  # every photo, in order
    assert all(g[2] is None and g[1] == [30, 40 + g[0], 3] for g in got), got  # decoded (again, in this process)
    warn = " ".join(res.stderr.split())
    assert "--ipc=host" in warn and "--shm-size" in warn and "--num-workers 0" in warn, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
