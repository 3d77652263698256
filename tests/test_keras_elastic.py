"""Horovod Elastic on Keras 3 with every technique, on real ranks (``horovodrun`` elastic mode,
a host discovery script written by the test: :func:`hvdsync.testing.run_elastic`), on both of
Keras' backends (the torch one with TensorFlow hidden); the torch twin is
tests/test_torch_elastic.py, with the same faults and checks.

Horovod's recipe: ``model.fit`` inside ``hvd.elastic.run`` with ``KerasState`` and the three
elastic callbacks. The fit drives the model without a technique; a callback steps one model
per technique on the same batch (``train_on_batch``), all carried by the same ``KerasState``,
so a fault hits every technique at the same step:

* ``kill``: 3 ranks, ``--min-np 2``; at step :data:`EVENT` one rank SIGKILLs itself between
  two models' steps (the others wait in the next model's collectives). The survivors restore
  the last commit, reset to 2 ranks and finish the epochs.
* ``remove``: 3 ranks, ``--min-np 2``; at step :data:`EVENT` rank 0 takes a host out of the
  discovery file; once the job went on as 2 the host is put back, a new rank joins at a
  commit and the three finish.

Checked: the job finishes at the expected size with every epoch done (the first epoch after a
reset only runs what it still had to run), no step is lost beyond the last commit, every
replica is identical after the final ``flush()``, nothing is non-finite, training learns.

Without a fault, one 2-rank job per backend checks ``commit()``/``restore()``/``sync()``
themselves with mixed precision and gradient accumulation (:data:`ROUND_TRIP`).
"""

from __future__ import annotations

import numpy as np
import pytest

from hvdsync.testing import HIDE_ENV, run_elastic, run_ranks
from tests.keras_models import embedding_model, key, mlp, one_thread, teacher_data, token_data
from tests.test_torch_elastic import (COMMIT_EVERY, FINAL, GLOO_TIMEOUT_S, Faults,
                                      check_final_sizes, check_identical_and_finite,
                                      check_learns, check_steps_lost)
from tests.test_torch_flush import TECHNIQUES

#: and delay='s local steps (compiled: the train function holds a host call around the update)
CASES = {"none": {}, **TECHNIQUES,
         "outer": dict(delay=dict(exchange_gradients=False, average_every=4, fragments=2,
                                  overlap=1, mix=0.5, compress="int8", outer_lr=0.7,
                                  outer_momentum=0.9))}
EPOCHS, STEPS_PER_EPOCH, BATCH = 3, 8, 16
#: Gloo's timeout bounds both noticing a dead peer (``kill``: short) and waiting at the
#: rendezvous for a rank that starts (``remove``: a new Keras process imports TensorFlow and
#: builds its models first, longer than the torch twin's 5 s)
GLOO_TIMEOUT = {"kill": GLOO_TIMEOUT_S, "remove": 60}
#: each backend's environment: the torch one runs with TensorFlow hidden
BACKENDS = {"tensorflow": {}, "torch": {"KERAS_BACKEND": "torch", HIDE_ENV: "tensorflow"}}


def _compiled(case: str, options: dict):
    import keras

    import hvdsync.keras as hvd
    model = embedding_model(vocab=60) if case == "sparse" else mlp()
    model.compile(optimizer=hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), **options),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(case: str, rank: int, n: int, seed: int = 0):
    """``n`` rows of this rank's data (a function of the rank and ``seed``)."""
    if case == "sparse":
        return token_data(1000 * seed + rank, n, vocab=60)
    return teacher_data(1000 * seed + rank, n)


def keras_elastic_body(scenario: str) -> dict:
    """Every case's model through ``scenario``; every rank's weights after the final flush,
    its resets (when, the size after, the step reached, the step resumed from), the events'
    times, and each model's losses."""
    import keras

    import hvdsync.keras as hvd
    hvd.init()
    one_thread()
    faults = Faults(scenario, hvd)
    models = {case: _compiled(case, options) for case, options in CASES.items()}
    for case, model in models.items():  # built (KerasState needs it): one batch of inputs
        model(_data(case, 0, 2)[0])
    state = hvd.elastic.KerasState(models["none"], epoch=0, batch=0,
                                   **{case: m for case, m in models.items() if case != "none"})
    losses: dict[str, list[float]] = {c: [] for c in CASES}

    def step() -> int:
        return state.epoch * STEPS_PER_EPOCH + state.batch
    state.register_reset_callbacks([faults.on_reset])

    class SideBySide(keras.callbacks.Callback):
        """Steps every technique's model on this step's batch, once the fit's model has
        taken it; the faults happen here."""

        def on_train_batch_end(self, batch, logs=None):
            t = step() - 1  # UpdateBatchStateCallback ran before this one
            others = [c for c in CASES if c != "none"]
            for i, case in enumerate(others):
                if i == len(others) // 2:
                    faults.maybe_die(t)  # between two models' steps
                x, y = _data(case, hvd.rank(), BATCH, seed=t + 1)
                losses[case].append(float(models[case].train_on_batch(x, y)))
            losses["none"].append(float(logs["loss"]))  # the step is whole
            faults.step_done(t)

    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=COMMIT_EVERY),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state), SideBySide()]

    @hvd.elastic.run
    def train(state) -> None:
        faults.resumed(step())
        x, y = _data("none", hvd.rank(), BATCH * STEPS_PER_EPOCH)
        state.model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=EPOCHS - state.epoch,
                        callbacks=callbacks, verbose=0)  # (STEPS_PER_EPOCH batches)

    train(state)
    for model in models.values():
        model.optimizer.flush()
    return dict(rank=hvd.rank(), size=hvd.size(), resets=faults.resets,
                events=faults.events(), losses=losses,
                epoch=state.epoch, batch=state.batch, steps_done=len(losses["none"]),
                params={c: {key(v): np.array(v.numpy()) for v in m.variables}
                        for c, m in models.items()},
                stats={c: m.optimizer.stats.as_dict()["total"] for c, m in models.items()})


def _run(backend: str, scenario: str) -> list[dict]:
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT[scenario]), **BACKENDS[backend]}
    out = run_elastic(keras_elastic_body, np=3, min_np=2, args=(scenario,), timeout=300,
                      env=env)
    return sorted(out, key=lambda r: r["rank"])


@pytest.fixture(scope="module", params=[(b, s) for b in BACKENDS for s in FINAL],
                ids=lambda p: "-".join(p))
def job(request):
    backend, scenario = request.param
    return scenario, _run(backend, scenario)


def test_the_job_finishes_at_the_new_size(job):
    scenario, ranks = job
    check_final_sizes(scenario, ranks)
    assert all((r["epoch"], r["batch"]) == (EPOCHS, 0) for r in ranks)


@pytest.mark.parametrize("case", list(CASES))
def test_replicas_identical_and_finite_after_flush(job, case):
    check_identical_and_finite(job[1], case)


def test_steps_lost_at_most_since_the_last_commit(job):
    scenario, ranks = job
    check_steps_lost(scenario, ranks)
    for r in ranks:  # every step of every epoch taken once, plus those lost and taken again
        if r["resets"]:
            again = sum(x["reached"] - x["from_step"] for x in r["resets"])
            assert r["steps_done"] == EPOCHS * STEPS_PER_EPOCH + again


def test_training_still_learns(job):
    check_learns(job[1], CASES)


# -- commit, restore and sync without a fault: mixed precision, gradient accumulation -----------
ROUND_TRIP = {
    "threshold, mixed_float16": (dict(threshold=dict(threshold=0.3, max_skip=4)), True, 1),
    "select, 2 passes per step": (dict(select=dict(k=1, max_wait=3)), False, 2),
    "delay, 2 passes per step": (dict(delay=dict(staleness=1, average_every=4)), False, 2),
}


def round_trip_body() -> dict:
    """Per case: fit, ``commit()``, fit on, ``restore()`` -> the committed weights, optimizer
    variables and technique state come back; then ``sync()``, fit, ``flush()`` -> identical
    replicas. A 2-rank job without a fault (``KerasState`` outside elastic mode)."""
    import keras

    import hvdsync.keras as hvd
    from hvdsync.safety import checkpoint
    hvd.init()
    one_thread()
    out = {}
    for case, (options, mixed, passes) in ROUND_TRIP.items():
        keras.mixed_precision.set_global_policy("mixed_float16" if mixed else "float32")
        model = mlp(seed=hvd.rank())  # different starts: sync() makes them one
        model.compile(optimizer=hvd.DistributedOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9), backward_passes_per_step=passes,
            **options), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x, y = teacher_data(hvd.rank(), 16 * 12)
        model(x[:1])
        state = hvd.elastic.KerasState(model, epoch=0, batch=0)
        state.sync()
        inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)

        def snapshot() -> dict:
            return dict(weights=[v.numpy().copy() for v in model.variables],
                        opt=[v.numpy().copy() for v in model.optimizer.variables],
                        digest=checkpoint.shared_digest(inner._configured))
        model.fit(x[:64], y[:64], batch_size=16, shuffle=False, verbose=0)
        state.commit()
        committed = snapshot()
        model.fit(x[64:128], y[64:128], batch_size=16, shuffle=False, verbose=0)
        moved = snapshot()
        state.restore()
        restored = snapshot()
        state.sync()
        model.fit(x[128:], y[128:], batch_size=16, shuffle=False, verbose=0)
        inner.flush()
        out[case] = dict(committed=committed, moved=moved, restored=restored,
                         final=[v.numpy().copy() for v in model.trainable_variables],
                         scaled=hasattr(model.optimizer, "inner_optimizer"))
    keras.mixed_precision.set_global_policy("float32")
    return out


def shared_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """The round trips (no fault, no elastic launch), in the session's shared rank job
    (tests/conftest.py)."""
    return {"round_trips": (round_trip_body,)} if np_ == 2 else {}


@pytest.fixture(scope="module", params=list(BACKENDS))
def round_trips(request, shared_job):
    if request.param == "tensorflow":
        return shared_job(request.module, 2)["round_trips"]
    return run_ranks(round_trip_body, np=2, timeout=240, env=BACKENDS["torch"])


@pytest.mark.parametrize("case", list(ROUND_TRIP))
def test_restore_brings_back_the_commit_and_sync_makes_replicas_one(round_trips, case):
    for r in round_trips:
        c, m, back = (r[case][k] for k in ("committed", "moved", "restored"))
        assert not all(np.array_equal(a, b) for a, b in zip(c["weights"], m["weights"]))
        for a, b in zip(c["weights"] + c["opt"], back["weights"] + back["opt"]):
            np.testing.assert_array_equal(a, b, err_msg=case)
        assert back["digest"] == c["digest"], case
    assert round_trips[0][case]["scaled"] == ROUND_TRIP[case][1]
    for a, b in zip(round_trips[0][case]["final"], round_trips[1][case]["final"]):
        np.testing.assert_array_equal(a, b, err_msg=case)


def elastic_on_torchrun_body() -> list[str]:
    """What ``elastic.run`` says under torchrun, where Horovod is installed but not the engine,
    from hvdsync.keras on the torch backend and from hvdsync.torch."""
    import hvdsync.keras as hvd
    import hvdsync.torch as hvd_torch
    hvd.init()
    said = []
    for module in (hvd.elastic, hvd_torch.elastic):
        try:
            module.run(lambda state: None)
        except RuntimeError as e:
            said.append(str(e))
    return said


def test_elastic_under_torchrun_says_to_use_its_restarts():
    for said in run_ranks(elastic_on_torchrun_body, np=2, timeout=120, launcher="torchrun",
                          env={"KERAS_BACKEND": "torch"}):
        assert len(said) == 2 and all("use torchrun --max-restarts" in s for s in said), said
