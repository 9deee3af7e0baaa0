"""Writer process for the SIGKILL test: writes images 0..N-1 (skipping committed ones), committing every K."""

from __future__ import annotations

import sys

from store_helpers import IDENTITY, add_image, synthetic_image

from pipeline.store import open_writer


def main() -> None:
    path, total, every, dim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    with open_writer(path, IDENTITY, commit_every=every) as writer:
        print("ready", writer.num_committed, flush=True)
        for i in range(total):
            rec = synthetic_image(i, dim)
            if not writer.has(rec["key"]):
                add_image(writer, rec)
    print("done", flush=True)


if __name__ == "__main__":
    main()
