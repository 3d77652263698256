"""The harness behind :mod:`hvdsync.testing`: launching ranks, collecting their results, a rank's
main (``python -m hvdsync.testing``)."""

from __future__ import annotations

import functools
import importlib
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from hvdsync.testing import progress
from hvdsync.testing.rank_errors import RanksFailed


@functools.cache
def _check_horovod_gloo() -> None:
    """Fail clearly unless Horovod is installed with Gloo -- once per process.

    ``horovodrun`` asks the same at every launch by forking a process that imports
    ``horovod.tensorflow`` (all of TensorFlow: ~5 s of CPU per job, most of a small job's
    time); :func:`run_ranks` asks once, in a fresh interpreter, and its launches skip it."""
    check = ("from horovod.common.util import gloo_built; import sys; "
             "sys.exit(0 if gloo_built() else 3)")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          env=rank_env(), timeout=300)
    if done.returncode == 3:
        raise RuntimeError("Horovod was built without Gloo, which hvdsync's launches use; "
                           "reinstall it with scripts/install_horovod.sh")
    if done.returncode != 0:
        raise RuntimeError("Horovod is not importable here (install it with "
                           f"scripts/install_horovod.sh):\n{done.stderr[-2000:]}")


#: how :func:`run_ranks` starts ranks: Horovod's launcher (the Horovod backend) or torch's
#: (the torch.distributed backend, :mod:`hvdsync.torch.engine`)
LAUNCHERS = ("horovodrun", "torchrun")


def launch_command(launcher: str, np: int, tmp: str, restarts: int = 0) -> list[str]:
    """The command line that starts ``np`` ranks on this host, each running the call written
    into ``tmp``; ``restarts``: torchrun's ``--max-restarts`` (every worker is started again
    after one fails, ``TORCHELASTIC_RESTART_COUNT`` counting the restarts)."""
    if restarts and launcher != "torchrun":
        raise ValueError("restarts are torchrun's (--max-restarts); Horovod's are elastic: "
                         "run_elastic")
    if launcher == "horovodrun":  # horovodrun's own code, less its per-launch Gloo check
        _check_horovod_gloo()
        return [sys.executable, "-m", "hvdsync.testing", "--horovodrun", "-np", str(np),
                "-H", f"localhost:{np}", "--gloo", *rank_command(tmp)]
    if launcher == "torchrun":  # --tee 3: every line prefixed with its rank, as horovodrun's
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={np}", f"--max-restarts={restarts}", "--tee=3",
                "--no-python", *rank_command(tmp)]
    raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")


def run_ranks(fn: Callable[..., Any], np: int, args: tuple = (), kwargs: dict | None = None,
              timeout: float = 180, env: dict[str, str] | None = None,
              launcher: str = "horovodrun", restarts: int = 0) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks (Gloo, this host) started by ``launcher``
    (``"horovodrun"`` or ``"torchrun"``, with ``restarts``: :func:`launch_command`); return
    per-rank results (a restarted rank's last), or raise :class:`RanksFailed` with every
    rank's output."""
    with tempfile.TemporaryDirectory(prefix="hvdsync-ranks-") as tmp:
        name = write_call(tmp, fn, args, kwargs)
        progress.job(f"{fn.__name__} on {np} ranks")
        start = time.monotonic()
        output, returncode, hung = _launch(launch_command(launcher, np, tmp, restarts), tmp,
                                           rank_env({**progress.job_env(tmp), **(env or {})}),
                                           timeout)
        return collect_results(tmp, np, name, hung, returncode, timeout,
                               time.monotonic() - start, output)


def _launch(cmd: list[str], tmp: str, env: dict[str, str], timeout: float
            ) -> tuple[str, int | None, bool]:
    """Run the launcher ``cmd`` to its end or ``timeout``; (output, exit code, hung). Every
    process of the job is gone when it returns, however it ends."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, text=True, errors="replace")
    hung = False
    try:
        output = _communicate(proc, tmp, timeout)
    except subprocess.TimeoutExpired:
        hung = True
        kill_job(proc, tmp)
        output, _ = proc.communicate(timeout=_GRACE_S)
    except BaseException:  # an error or Ctrl-C here: take the ranks down with us
        kill_job(proc, tmp)
        raise
    finally:
        kill_job(proc, tmp)  # stragglers of a finished launcher
    return output, proc.returncode, hung


def _communicate(proc: subprocess.Popen, tmp: str, timeout: float) -> str:
    """``proc``'s output once it ends (``TimeoutExpired`` past ``timeout``), showing the
    ranks' progress meanwhile where a display is shown (:mod:`hvdsync.testing.progress`)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            output = proc.communicate(timeout=min(1.0, max(deadline - time.monotonic(), 0.01))
                                      if progress.job_env(tmp) else timeout)[0]
            progress.poll(tmp)  # (the ranks' last report)
            return output
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline or not progress.job_env(tmp):
                raise
            progress.poll(tmp)


def elastic_host_names() -> list[str]:
    """The names under which this machine is each "host" of :func:`run_elastic` (Horovod runs
    a host locally when its address is one of the machine's; a failure blacklists the whole
    host, so a rank lost or added is a host lost or added: one slot per name)."""
    import socket
    return ["localhost", "127.0.0.1", socket.gethostname()]


#: set in the ranks of :func:`run_elastic`: the file its discovery script prints (one
#: ``host:1`` line per host; a body may rewrite it to add or remove hosts)
HOSTS_ENV = "HVDSYNC_ELASTIC_HOSTS"


def run_elastic(fn: Callable[..., Any], np: int, min_np: int, max_np: int | None = None,
                hosts: int | None = None, args: tuple = (), kwargs: dict | None = None,
                timeout: float = 300, env: dict[str, str] | None = None,
                cooldown_s: tuple[int, int] | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` under ``horovodrun``'s elastic mode on this machine
    (``--min-np``/``--max-np``, a host discovery script; ranks come and go): ``np`` ranks
    to start, one per host name (:func:`elastic_host_names`), the first ``hosts`` of them
    (default ``np``) listed at the start. The body finds the hosts file in
    ``os.environ[HOSTS_ENV]`` and may rewrite it; ``cooldown_s``: a failed host comes back
    after that many seconds (``--blacklist-cooldown-range``), else it stays out.

    Returns the results of every process that returned (a killed one has none; one that joined
    later has one), in no particular order: put the rank in the result. A process that
    raises, a non-zero exit of the job, or a job running past ``timeout`` seconds raises
    :class:`RanksFailed` with every process's output; nothing is left behind."""
    names = elastic_host_names()
    max_np = np if max_np is None else max_np
    if max_np > len(names):
        raise ValueError(f"run_elastic runs at most {len(names)} ranks here (one per host name)")
    _check_horovod_gloo()
    with tempfile.TemporaryDirectory(prefix="hvdsync-ranks-") as tmp:
        name = write_call(tmp, fn, args, kwargs)
        progress.job(f"{fn.__name__} on {np} elastic ranks")
        hosts_file = os.path.join(tmp, "hosts")
        with open(hosts_file, "w") as f:
            f.write("".join(f"{h}:1\n" for h in names[:hosts or np]))
        discover = os.path.join(tmp, "discover.sh")
        with open(discover, "w") as f:
            f.write(f"#!/bin/sh\ncat {hosts_file}\n")
        os.chmod(discover, 0o755)
        cmd = [sys.executable, "-m", "hvdsync.testing", "--horovodrun", "-np", str(np),
               "--min-np", str(min_np), "--max-np", str(max_np),
               "--host-discovery-script", discover, "--gloo"]
        if cooldown_s is not None:
            cmd += ["--blacklist-cooldown-range", str(cooldown_s[0]), str(cooldown_s[1])]
        cmd += rank_command(tmp)
        start = time.monotonic()
        output, returncode, hung = _launch(cmd, tmp, rank_env({
            HOSTS_ENV: hosts_file, **progress.job_env(tmp), **(env or {})}), timeout)
        done = sorted(f for f in os.listdir(tmp) if f.startswith("done.") and f.endswith(".pkl"))
        results = []
        for f in done:
            with open(os.path.join(tmp, f), "rb") as fh:
                results.append(pickle.load(fh))
        if hung or returncode != 0 or not results:
            what = (f"timed out after {timeout:.0f}s (hang?); all ranks killed" if hung
                    else f"exited with code {returncode}" if returncode
                    else "no process returned a result")
            raise RanksFailed(f"{name} elastic ({np} ranks, --min-np {min_np}) {what} "
                              f"({time.monotonic() - start:.1f}s).\n"
                              f"{format_rank_output(output, max_np)}", workdir=tmp)
        return results


def run_threads(fn: Callable[..., Any], np: int, args: tuple = (), kwargs: dict | None = None,
                timeout: float = 60.0) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``np`` *simulated* ranks: threads of this process whose
    ``hvdsync.torch`` collectives meet in memory (:mod:`hvdsync.testing.simulated`: one rank
    runs at a time, each with its own random state; collectives pair by order and must agree).
    Same contract as :func:`run_ranks` -- per-rank results, or :class:`RanksFailed` with each
    failing rank's traceback; a wait longer than ``timeout`` seconds fails instead of hanging
    -- in milliseconds instead of seconds. For the core's logic; parity, launchers and
    crashes need real ranks."""
    from hvdsync.testing import simulated
    return simulated.run(fn, np, args, kwargs, timeout)


#: the most seconds to wait for killed processes to go
_GRACE_S = 30.0


def processes_of(workdir: str) -> list:
    """The live processes whose command line mentions ``workdir`` (a job's ranks and the
    shells that started them)."""
    import psutil
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != os.getpid() and any(workdir in part for part in p.info["cmdline"] or ()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def kill_job(proc: subprocess.Popen, workdir: str) -> None:
    """Kill the launcher ``proc``, everything under it and every process of ``workdir`` (the
    ranks run in sessions of their own and outlive a killed launcher), waiting at most
    :data:`_GRACE_S` seconds."""
    import psutil
    victims = []
    try:
        launcher = psutil.Process(proc.pid)
        victims = [launcher, *launcher.children(recursive=True)]
    except psutil.NoSuchProcess:
        pass
    victims += processes_of(workdir)
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=_GRACE_S)
    if proc.poll() is None:
        proc.wait(timeout=_GRACE_S)


# -- pieces for launchers of ranks (run_ranks above; benchmarks/network.py) -----------------
def write_call(tmp: str, fn: Callable[..., Any], args: tuple, kwargs: dict | None) -> str:
    """Write the call every rank makes into ``tmp``; returns ``module.qualname``."""
    module, qualname = fn.__module__, fn.__qualname__
    if module == "__main__":  # run as `python -m pkg.mod`: ranks import it by that name
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name if spec is not None else module
    if module == "__main__" or "<locals>" in qualname:
        raise ValueError("run_ranks needs a module-level function of an importable module, "
                         f"got {module}.{qualname}")
    with open(os.path.join(tmp, "call.pkl"), "wb") as f:
        pickle.dump((module, qualname, args, kwargs or {}), f)
    return f"{module}.{qualname}"


def rank_command(tmp: str) -> list[str]:
    """The command a rank runs to make the call written by :func:`write_call`."""
    return [sys.executable, "-m", "hvdsync.testing", tmp]


def rank_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for rank processes: this one, plus what ranks need to import the caller's
    modules, and one intra-op thread each (several ranks share few cores)."""
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p and os.path.isdir(p)])
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    child_env.update(extra or {})
    return child_env


def collect_results(tmp: str, np: int, name: str, hung: bool, returncode: int | None,
                    timeout: float, elapsed: float, output: str) -> list[Any]:
    """Every rank's result from ``tmp``, or :class:`RanksFailed` with the ranks' output
    (``output`` in horovodrun's ``[rank]<stream>:`` line format)."""
    results, missing = [], []
    for r in range(np):
        path = os.path.join(tmp, f"rank{r}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        else:
            missing.append(r)
    if hung or returncode != 0 or missing:
        what = (f"timed out after {timeout:.0f}s (hang?); all ranks killed" if hung
                else f"exited with code {returncode}" if returncode
                else f"ranks {missing} returned no result")
        raise RanksFailed(f"{name} on {np} ranks {what} ({elapsed:.1f}s).\n"
                          f"{format_rank_output(output, np)}", workdir=tmp)
    return results


# horovodrun's "[1]<stdout>:line" and torchrun --tee's "[default1]:line"
_PREFIX = re.compile(r"^\[(?:default)?(\d+)\](?:<(?:stdout|stderr)>)?:(.*)$")


def format_rank_output(output: str, np: int, tail: int = 60) -> str:
    """Group the launcher's interleaved per-rank lines by rank (last ``tail`` each)."""
    per_rank: dict[str, list[str]] = {str(r): [] for r in range(np)}
    launcher: list[str] = []
    for line in output.splitlines():
        m = _PREFIX.match(line)
        if m:
            per_rank.setdefault(m.group(1), []).append(m.group(2))
        else:
            launcher.append(line)
    parts = []
    for r, lines in per_rank.items():
        parts.append(f"----- rank {r} ({len(lines)} lines, last {tail}) -----")
        parts.extend(lines[-tail:])
    parts.append(f"----- launcher (last {tail} lines) -----")
    parts.extend(launcher[-tail:])
    return "\n".join(parts)


#: comma-separated modules a rank treats as not installed (``sys.modules[name] = None``): tests
#: of an install without them, e.g. ``run_ranks(..., env={HIDE_ENV: "horovod"})``
HIDE_ENV = "HVDSYNC_HIDE_MODULES"


def _rank_main(tmp: str) -> None:
    for hidden in filter(None, os.environ.get(HIDE_ENV, "").split(",")):
        sys.modules[hidden] = None  # type: ignore[assignment]
    with open(os.path.join(tmp, "call.pkl"), "rb") as f:
        module, qualname, args, kwargs = pickle.load(f)
    from hvdsync.safety.watchdog import launcher_rank
    rank = launcher_rank()
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    try:
        result = obj(*args, **kwargs)
    except BaseException:
        print(f"rank {rank}: {module}.{qualname} raised:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # do not wait for other ranks in Horovod's shutdown
    # elastic (run_elastic): ranks are renumbered as the job changes; one file per process
    out = f"done.{os.getpid()}.pkl" if HOSTS_ENV in os.environ else f"rank{rank}.pkl"
    with open(os.path.join(tmp, out + ".tmp"), "wb") as f:
        pickle.dump(result, f)
    os.replace(os.path.join(tmp, out + ".tmp"), os.path.join(tmp, out))


def _horovodrun_main(argv: list[str]) -> None:
    """``horovodrun argv...``, trusting :func:`_check_horovod_gloo`'s answer."""
    from horovod.runner import launch
    launch.gloo_built = lambda verbose=False: True  # checked once by the caller
    sys.argv = ["horovodrun", *argv]
    sys.exit(launch.run_commandline())


def main(argv: list[str]) -> None:
    """A rank's process (``python -m hvdsync.testing``): horovodrun's, or the call's."""
    if argv[0] == "--horovodrun":
        _horovodrun_main(argv[1:])
    else:
        _rank_main(argv[0])
