"""Run ``cli.py train ARGS`` and SIGKILL this very process at one exact point (tests/test_resume_boundaries.py).

``BUTD_TEST_KILL`` picks the point: ``epoch_end:STAGE:E`` (just after the last.pt of STAGE's epoch E end is
written), ``step:STAGE:N`` (before optimiser step N of STAGE, several steps after the last checkpoint) or
``validation:STAGE:E`` (in the middle of validating STAGE's epoch E, after the first decoded batch). The
trainer itself is not changed: its methods are wrapped here, in the child only.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

from pipeline.training import engine, validation

kind, stage, at = os.environ["BUTD_TEST_KILL"].split(":")
at_n = int(at)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


save, step = engine.Trainer._save, engine.Trainer._step


def _save(self, name, ckpt):
    save(self, name, ckpt)
    prog = ckpt.progress
    if (
        kind == "epoch_end"
        and name == "last.pt"
        and prog.stage == stage
        and prog.epoch == at_n + 1
        and prog.position == 0
        and not prog.stage_done
    ):
        die()


def _step(self, st, recipe, batch, prog, optimizer, scaler):
    if kind == "step" and st == stage and prog.iteration + 1 == at_n:
        die()
    return step(self, st, recipe, batch, prog, optimizer, scaler)


def _validate(self, prog):
    if kind == "validation" and prog.stage == stage and prog.epoch == at_n:
        calls = []

        def dying_generate(*args, **kw):  # the second validation batch: the first one is decoded, the rest is not
            if calls:
                die()
            calls.append(1)
            return generate(*args, **kw)

        validation.generate = dying_generate
    return validate(self, prog)


generate = validation.generate
validate = engine.Trainer.validate
engine.Trainer._save, engine.Trainer._step, engine.Trainer.validate = _save, _step, _validate
sys.argv = [str(Path(__file__).resolve().parents[1] / "cli.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
