"""Keras: ``FlushCallback`` (``flush()`` at the end of ``fit``) leaves identical replicas --
weights and optimizer variables -- for every technique and every pair that combines, and for
the outer synchronization, on 2 real ranks with different data per rank (each technique
alone and the outer synchronization on 3 as well); the torch twin is
tests/test_torch_flush.py, with the same technique settings."""

from __future__ import annotations

import numpy as np
import pytest

from tests.keras_models import fit_body
from tests.models import REAL_NP, REAL_NP_IDS
from tests.test_torch_flush import OUTER, PAIRS, SINGLES, TECHNIQUES

STEPS = 11  # not a multiple of any K or max_skip here: something is pending at the end


def _options(names: tuple[str, ...]) -> dict:
    if names == ("outer",):
        return dict(OUTER)
    return {k: v for n in names for k, v in TECHNIQUES[n].items()}


CASES = {"+".join(names): names for names in SINGLES + PAIRS + [("outer",)]}
#: per rank count, the cases run: every pair at 2 ranks; at 3 (a job of TensorFlow processes
#: on 2 cores costs ~2.5 s a case) each technique alone and the outer synchronization -- the
#: pairs at 3 ranks run in torch (tests/test_torch_flush.py, Horovod and simulated ranks)
CASES_AT = {2: list(CASES), 3: ["+".join(names) for names in SINGLES + [("outer",)]]}


def flush_case(names: tuple[str, ...]) -> dict:
    model = "emb" if "sparse" in names else "mlp"
    out = fit_body(_options(names), "momentum", 0.05, STEPS, 16, model=model, vocab=60,
                   record_weights=True, callbacks=("broadcast", "flush"))
    return dict(final=out["final"], opt_vars=out["opt_vars"], last=out["weights"][-1],
                # the bytes of the steps that sent no layer (a decider's control vector alone)
                quiet=[s["bytes_sent"] for s, sent in zip(out["steps"], out["sent"])
                       if not sent], layers=len(out["layers"]))


def shared_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared rank job (tests/conftest.py)."""
    return {name: (flush_case, CASES[name]) for name in CASES_AT.get(np_, [])}


@pytest.fixture(scope="module", params=REAL_NP, ids=REAL_NP_IDS)
def runs(request, shared_job):
    return shared_job(request.module, request.param)


RUN = [(n, c) for n in REAL_NP for c in CASES_AT[n]]


# delay= and the outer synchronization keep each rank's optimizer state (momentum built from
# its own gradients, docs/delay.md): flush() makes the weights identical, not that state
LOCAL_STATE = [c for c in CASES if "delay" in c or c == "outer"]


@pytest.mark.parametrize("np_, case", RUN, ids=[f"np{n}-{c}" for n, c in RUN])
def test_flush_callback_leaves_identical_replicas(request, shared_job, np_, case):
    ranks = shared_job(request.module, np_)[case]
    for r in ranks:
        assert all(np.isfinite(w).all() for w in r["final"].values()), case
    for other in ranks[1:]:
        for k, v in ranks[0]["final"].items():
            np.testing.assert_array_equal(v, other["final"][k], err_msg=f"{case} {k}")
        if case in LOCAL_STATE:
            continue
        for k, v in ranks[0]["opt_vars"].items():
            np.testing.assert_array_equal(v, other["opt_vars"][k], err_msg=f"{case} {k}")


def test_a_float32_models_control_vector_is_float32(runs):
    """A decider's control vector travels in the gradients' precision (here float32: one
    value per layer, then the non-finite flag), so Horovod fuses it with the data
    (benchmarks/results/keras_lab_notes.md, "The control vector in the gradients'
    precision"); a step that sends no
    layer sends that alone."""
    for r in runs["threshold"]:
        assert r["quiet"] and set(r["quiet"]) == {4 * (r["layers"] + 1)}, r["quiet"]


@pytest.mark.parametrize("case", ["threshold", "delay", "outer"])
def test_the_replicas_differed_before_the_flush(runs, case):
    """The test can fail: these techniques leave the replicas apart before flush()."""
    ranks = runs[case]
    assert any(not all(np.array_equal(ranks[0]["last"][k], o["last"][k]) for k in o["last"])
               for o in ranks[1:]), case
