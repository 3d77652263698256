"""Horovod Elastic with every technique, on real ranks (``horovodrun`` elastic mode, a host
discovery script written by the test: :func:`hvdsync.testing.run_elastic`).

One job per fault trains one model per technique side by side in one ``TorchState`` -- a
fault hits all of them at the same step -- and, at the end, flushes every optimizer and
returns every rank's parameters:

* ``kill``: 3 ranks, ``--min-np 2``; at step :data:`EVENT` one rank SIGKILLs itself in the
  middle of a step (after its backward, while the others wait in that step's collectives).
  The two survivors restore the last commit, reset to 2 ranks and finish.
* ``remove``: 3 ranks, ``--min-np 2``; at step :data:`EVENT` rank 0 takes a host out of the
  discovery file (its rank is stopped at the next commit, the other two go on as 2) and puts
  it back once the job went on as 2: a new rank starts there and joins at a commit (its
  optimizers built while the others wait in ``sync()``); the three finish.

Checked per technique: the job finishes at the expected size, no step is lost beyond the
last commit, every replica is identical after the final ``flush()``, nothing is non-finite,
and training still learns. docs/elastic.md has the figures.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from torch import nn

from hvdsync.testing import HOSTS_ENV, run_elastic
from tests.models import MLP
from tests.test_torch_compositions import BagModel
from tests.test_torch_flush import TECHNIQUES

CASES = {"none": {}, **TECHNIQUES}
STEPS = 40
EVENT = 13  # the fault's step: one after a commit, so a lost rank costs the step in flight
COMMIT_EVERY = 4
#: survivors notice a dead peer within this many seconds (Gloo's default is 30)
GLOO_TIMEOUT_S = 5


def _batch(case: str, rank: int, step: int) -> tuple:
    """This rank's batch for ``step`` (a function of both: ranks are renumbered)."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    if case == "sparse":
        p = 1.0 / torch.arange(1, 61, dtype=torch.float64)
        ids = torch.multinomial(p / p.sum(), 40, replacement=True, generator=g)
        y = torch.isin(ids.view(8, 5), torch.tensor([2, 5, 9])).any(1).long()
        return (ids, torch.arange(0, 40, 5)), y
    w = torch.randn(12, 4, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(16, 12, generator=g)
    return (x,), (x @ w).argmax(dim=1)


def _first(workdir: str, name: str) -> bool:
    """True for the one process that creates ``workdir/name`` (the time goes in it)."""
    try:
        fd = os.open(os.path.join(workdir, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, repr(time.time()).encode())
    os.close(fd)
    return True


def _victim(scenario: str, rank: int, workdir: str) -> bool:
    """``kill``: rank 2 dies (once: not a rank that joins later)."""
    return scenario == "kill" and rank == 2 and _first(workdir, "killed")


def _remove_host(hosts_file: str) -> None:
    """Take a host out of the discovery file (a graceful removal: its rank is stopped at the
    next commit); its line is kept in ``gone`` beside the file for :func:`_add_host_back`."""
    with open(hosts_file) as f:
        lines = f.readlines()
    # not this process's own host: it puts the host back
    gone = [line for line in lines if line.split(":")[0] != os.environ["HOROVOD_HOSTNAME"]][-1]
    with open(os.path.join(os.path.dirname(hosts_file), "gone"), "w") as f:
        f.write(gone)
    with open(hosts_file, "w") as f:
        f.writelines(line for line in lines if line != gone)


def _add_host_back(hosts_file: str) -> None:
    """Put the removed host back (once: the first survivor whose reset brought the job down
    to 2 ranks); a new rank starts there and joins at a commit."""
    workdir = os.path.dirname(hosts_file)
    if os.path.exists(os.path.join(workdir, "gone")) and _first(workdir, "added"):
        with open(os.path.join(workdir, "gone")) as f, open(hosts_file, "a") as hosts:
            hosts.write(f.read())


class Faults:
    """What both adapters' elastic bodies share: ``scenario``'s faults, and the record of this
    process's resets (when, the size after, the step reached before, the step it resumed
    from) and of the events (``killed``, ``removed``, ``added``, written by whichever process
    made them). ``hvd``: the adapter's module (its rank and size are read anew each time)."""

    def __init__(self, scenario: str, hvd):
        self.scenario, self.hvd = scenario, hvd
        self.hosts_file = os.environ[HOSTS_ENV]
        self.workdir = os.path.dirname(self.hosts_file)
        self.resets: list[dict] = []
        self.reached = 0
        #: this process joined a running job (its first sync brought a later step)
        self.joined_late = False

    def on_reset(self) -> None:
        """The state's reset callback."""
        self.resets.append(dict(at=time.time(), size=self.hvd.size(), reached=self.reached))
        if self.scenario == "remove" and self.hvd.size() < 3:  # went on without the host
            _add_host_back(self.hosts_file)

    def resumed(self, step: int) -> None:
        """The elastic function starts (after the sync) at ``step``."""
        self.joined_late = self.joined_late or (step > 0 and not self.resets)
        if self.resets and "resumed" not in self.resets[-1]:
            self.resets[-1]["resumed"] = time.time()  # after the sync: training goes on
            self.resets[-1]["from_step"] = step

    def maybe_die(self, t: int) -> None:
        """``kill``: at step :data:`EVENT` the victim SIGKILLs itself (call it mid-step)."""
        if t == EVENT and _victim(self.scenario, self.hvd.rank(), self.workdir):
            os.kill(os.getpid(), signal.SIGKILL)  # the others wait in this step's collectives

    def step_done(self, t: int) -> None:
        """Step ``t`` is whole. ``remove``: at :data:`EVENT` rank 0 takes a host out; from
        then on steps are slowed until the job is whole again (the driver notices in ~1 s,
        a new rank starts in seconds)."""
        self.reached = max(self.reached, t + 1)
        if self.scenario != "remove" or t < EVENT:
            return
        if t == EVENT and self.hvd.rank() == 0 and _first(self.workdir, "removed"):
            _remove_host(self.hosts_file)
        if self.hvd.size() < 3 or not (self.resets or self.joined_late):
            time.sleep(0.5)

    def events(self) -> dict[str, float]:
        out = {}
        for name in ("killed", "removed", "added"):
            if os.path.exists(os.path.join(self.workdir, name)):
                with open(os.path.join(self.workdir, name)) as f:
                    out[name] = float(f.read())
        return out


def elastic_body(scenario: str, cases: tuple[str, ...] = tuple(CASES)) -> dict:
    """One model per technique in ``cases`` through ``scenario``; every rank's parameters
    after the final flush, its resets (when, the size after, the step reached before, the
    step it resumed from) and the times of the events (``killed``, ``removed``, ``added``)."""
    import hvdsync.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    faults = Faults(scenario, hvd)
    models, opts = {}, {}
    for case in cases:
        torch.manual_seed(0)
        options = CASES[case]
        models[case] = model = BagModel() if case == "sparse" else MLP()
        opts[case] = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=[(f"{case}.{n}", p) for n, p in model.named_parameters()],
            **options)
    state = hvd.elastic.TorchState(step=0, **{f"model_{c}": m for c, m in models.items()},
                                   **{f"opt_{c}": o for c, o in opts.items()})
    losses: dict[str, list[float]] = {c: [] for c in cases}
    state.register_reset_callbacks([faults.on_reset])

    @hvd.elastic.run
    def train(state) -> None:
        faults.resumed(state.step)
        while state.step < STEPS:
            t = state.step
            for case in cases:
                model, opt = models[case], opts[case]
                inputs, y = _batch(case, hvd.rank(), t)
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(*inputs), y)
                loss.backward()
                if case == cases[len(cases) // 2]:
                    faults.maybe_die(t)  # mid-step: after its backward
                opt.step()
                losses[case].append(loss.item())
            state.step = t + 1
            faults.step_done(t)
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    train(state)
    for opt in opts.values():
        opt.flush()
    params = {c: torch.cat([p.detach().flatten() for p in m.parameters()]).numpy()
              for c, m in models.items()}
    return dict(rank=hvd.rank(), size=hvd.size(), resets=faults.resets, params=params,
                events=faults.events(), losses=losses,
                stats={c: o.stats.as_dict()["total"] for c, o in opts.items()})


#: per scenario: the ranks at the end, and the sizes a rank that was there from the start
#: went through
FINAL = {"kill": 2, "remove": 3}
SIZES = {"kill": [2], "remove": [2, 3]}


def _run(scenario: str) -> list[dict]:
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT_S)}
    out = run_elastic(elastic_body, np=3, min_np=2, args=(scenario,), timeout=240, env=env)
    return sorted(out, key=lambda r: r["rank"])


@pytest.fixture(scope="module", params=list(FINAL))
def job(request):
    return request.param, _run(request.param)


def check_final_sizes(scenario: str, ranks: list[dict]) -> None:
    """The job ends at the scenario's size; the two ranks there from start to end went
    through its sizes; with ``remove``, one rank joined (it never went through a reset)."""
    assert [r["rank"] for r in ranks] == list(range(FINAL[scenario]))
    assert all(r["size"] == FINAL[scenario] for r in ranks)
    original = [r for r in ranks if r["resets"]]
    assert len(original) == 2, "two ranks were there from the start to the end"
    for r in original:
        assert [x["size"] for x in r["resets"]] == SIZES[scenario]
    if scenario == "remove":
        assert len([r for r in ranks if not r["resets"]]) == 1


def check_identical_and_finite(ranks: list[dict], case: str) -> None:
    """``case``'s parameters (one array, or arrays by name) finite on every rank, bit-identical
    to rank 0's."""
    def arrays(r: dict) -> dict:
        p = r["params"][case]
        return p if isinstance(p, dict) else {"all": p}
    for r in ranks:
        assert all(np.isfinite(w).all() for w in arrays(r).values()), (case, r["rank"])
    for r in ranks[1:]:
        for k, w in arrays(ranks[0]).items():
            np.testing.assert_array_equal(w, arrays(r)[k],
                                          err_msg=f"{case} {k}: rank {r['rank']} differs")


def check_steps_lost(scenario: str, ranks: list[dict]) -> None:
    """A lost rank: back to the last commit before the step in flight; ranks removed or
    added at a commit: nothing lost."""
    for r in ranks:
        for reset in r["resets"]:
            lost = reset["reached"] - reset["from_step"]
            if scenario == "kill":
                assert reset["from_step"] == EVENT - EVENT % COMMIT_EVERY
                assert 0 < lost <= COMMIT_EVERY
            else:
                assert lost == 0


def check_learns(ranks: list[dict], cases) -> None:
    for case in cases:
        first, last = ranks[0]["losses"][case][:4], ranks[0]["losses"][case][-4:]
        assert np.mean(last) < np.mean(first), case


def test_the_job_finishes_at_the_new_size(job):
    check_final_sizes(*job)


@pytest.mark.parametrize("case", list(CASES))
def test_replicas_identical_and_finite_after_flush(job, case):
    check_identical_and_finite(job[1], case)


def test_steps_lost_at_most_since_the_last_commit(job):
    check_steps_lost(*job)


def test_training_still_learns(job):
    check_learns(job[1], CASES)
