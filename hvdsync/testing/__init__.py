"""Run a function on N real ranks -- Horovod's (``horovodrun --gloo``) or torch's
(``torchrun``) -- with a timeout; used by hvdsync's tests and benchmarks, usable for yours::

    from hvdsync.testing import run_ranks

    def body(scale):                      # module level of an importable module
        import hvdsync.torch as hvd
        hvd.init()
        return hvd.rank() * scale

    assert run_ranks(body, np=3, args=(2,)) == [0, 2, 4]

Results come back by rank; a rank that raises, a non-zero exit or a job past ``timeout``
raises :class:`RanksFailed` with every rank's output, and no rank process is left behind.
"""

from hvdsync.testing.harness import (HIDE_ENV, HOSTS_ENV, LAUNCHERS, collect_results,
                                     format_rank_output, kill_job, launch_command,
                                     processes_of, rank_command, rank_env, run_elastic,
                                     run_ranks, run_threads, write_call)
from hvdsync.testing.rank_errors import RanksFailed, SimulationError

__all__ = ["HIDE_ENV", "HOSTS_ENV", "LAUNCHERS", "RanksFailed", "SimulationError",
           "collect_results", "format_rank_output", "kill_job", "launch_command",
           "processes_of", "rank_command", "rank_env", "run_elastic", "run_ranks",
           "run_threads", "write_call"]
