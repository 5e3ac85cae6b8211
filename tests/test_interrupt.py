"""StopSignals in one process: a stop signal ends an abortable call at once, skips one not yet
started, is what `agreed` returns at the next step boundary, and the previous handlers come back.
Real runs stopped by SIGINT and SIGTERM: tests/test_distill.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from turnopd.core.interrupt import RunStopped, StopSignals


def test_a_stop_signal_ends_an_abortable_call_at_once_and_is_agreed_at_the_boundary(monkeypatch):
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    before = signal.getsignal(signal.SIGTERM)
    finished = []

    def evaluation() -> str:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the call runs
        time.sleep(5)  # never reached to its end: the handler ends the call
        finished.append(True)
        return "result"

    with StopSignals() as stop:
        assert stop.agreed() is None  # no signal yet: go on
        assert stop.abortable(lambda: "done", "stopped") == "done"
        assert stop.abortable(evaluation, "stopped") == "stopped"
        assert not finished and stop.received == signal.SIGTERM
        assert stop.abortable(lambda: finished.append(True), "skipped") == "skipped"  # not started after a stop
        assert stop.agreed() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_exit_code_is_the_conventional_one(signum, code, tmp_path):
    stopped = RunStopped(signum, 3, 10, tmp_path, tmp_path / "checkpoints" / "step_000003")
    assert stopped.exit_code == code
    assert str(stopped) == f"stopped by {signal.Signals(signum).name} after step 3 of 10"
