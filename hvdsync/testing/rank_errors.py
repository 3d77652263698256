"""The errors of jobs run for tests and benchmarks, in a module that imports nothing of
hvdsync's: the rank harness (:mod:`hvdsync.testing`) and the simulated ranks
(:mod:`hvdsync.testing.simulated`) both raise them, and neither imports the other for it."""

from __future__ import annotations


class RanksFailed(AssertionError):
    """A multi-rank job failed, crashed or hung; the message has every rank's output.
    ``workdir`` is the job's (deleted) scratch directory: every rank's command line holds it."""

    def __init__(self, message: str, workdir: str = ""):
        super().__init__(message)
        self.workdir = workdir


class SimulationError(RuntimeError):
    """A simulated collective failed: ranks disagreed, one never came, or one raised."""
