"""Stops that people and schedulers cause: SIGINT (Ctrl-C) and SIGTERM (what a cluster scheduler sends
before it preempts a job) end a run at its next safe point instead of wherever they land.

`StopSignals` is installed for a run, in its main thread. The first SIGINT or SIGTERM is noted and
the loop stops at the end of the step in progress (`agreed`: on every rank at the same step), after
writing a checkpoint when the recipe asks for one (`checkpoint.on_stop`); inside an `abortable` call
(set-up, an evaluation: nothing there to finish) it stops at once. A second Ctrl-C ends the
process at once, without a checkpoint. The run then ends with RunStopped, which the command turns
into one line naming the last step, the checkpoint and the `--resume` command, and the
conventional exit code (128 + the signal: 130, 143).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TypeVar

from turnopd.core.distributed import gather_objects, rank_and_world

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
T = TypeVar("T")


class Interrupted(BaseException):
    """A stop signal arrived inside an abortable call: it ends at once. A BaseException, as
    KeyboardInterrupt is, so that no `except Exception` on the way swallows it."""


class RunStopped(Exception):
    """The run in `run_dir` stopped on a signal after `step` optimizer steps; `checkpoint` is its newest
    complete one (None: nothing to resume from)."""

    def __init__(self, signum: int, step: int, total_steps: int, run_dir: Path | None, checkpoint: Path | None):
        self.signum, self.step, self.total_steps = signum, step, total_steps
        self.run_dir, self.checkpoint = run_dir, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step} of {total_steps}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """The run's SIGINT and SIGTERM handlers (module docstring); a context manager that restores the
    previous handlers on exit."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._abortable = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python delivers signals there only
            self._previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            if signum == signal.SIGINT:
                print("\nsecond interrupt: ending now, without a checkpoint", file=sys.stderr, flush=True)
                os._exit(128 + signum)
            return
        self.received = signum
        if rank_and_world()[0] == 0:
            print(f"\n{signal.Signals(signum).name}: the run stops at its next safe point (the end of this step; "
                  "at once in set-up or an evaluation). Ctrl-C again to end at once", file=sys.stderr, flush=True)
        if self._abortable:
            raise Interrupted

    def abortable(self, call: Callable[[], T], stopped: T) -> T:
        """call(), ended at once by a stop signal, or not started when one came before: `stopped` then.
        With several ranks it runs to its end (the ranks must meet in its collectives)."""
        if rank_and_world()[1] > 1:
            return call()
        if self.received is not None:
            return stopped
        self._abortable = True
        try:
            return call()
        except Interrupted:
            return stopped
        finally:
            self._abortable = False

    def agreed(self) -> int | None:
        """The signal that stops the run at this step boundary, the same on every rank (a collective:
        every rank calls it), or None to go on."""
        received = [signum for signum in gather_objects(self.received) if signum is not None]
        return received[0] if received else None
