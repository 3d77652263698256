"""Reliability of hvdsync.keras in the setups people run (issue: mixed precision, checkpoints,
bad values, disagreeing ranks, dead ranks), through ``model.fit`` on real ranks with
different data per rank."""

from __future__ import annotations

import pytest

from hvdsync.testing import run_ranks
from tests.keras_models import fit_body


def disagreeing_rank() -> dict:
    """Each case sets one thing up differently on rank 1; every rank must raise the same
    error (at the first step, when the optimizer is built), not hang."""
    import hvdsync.keras as hvd
    hvd.init()
    r = hvd.rank()
    out = {}
    for kind, options in {"select_k": dict(select=dict(k=1 + r)),
                          "technique": dict(threshold=0.5) if r == 0 else dict(select=1),
                          "staleness": dict(delay=dict(staleness=1 + r))}.items():
        try:
            fit_body(options, "sgd", 0.1, 2, 16, record_weights=False)
            out[kind] = "no error"
        except hvd.RanksDisagree as e:
            out[kind] = str(e)
    return out


@pytest.mark.parametrize("np_", [2, 3])
def test_ranks_that_disagree_all_raise_the_same_error(np_):
    ranks = run_ranks(disagreeing_rank, np=np_, timeout=300)
    for kind, field in (("select_k", "select="), ("technique", "select="),
                        ("staleness", "delay=")):
        messages = [r[kind] for r in ranks]
        assert all(m == messages[0] for m in messages), messages
        assert f"-- {field}:" in messages[0], messages[0]


def validate_on_rank_zero_only() -> dict:
    """``fit`` with ``validation_data`` on rank 0 only, delay=, FlushCallback and
    MetricAverageCallback: no hang; the validation sees identical replicas; the metrics every
    rank has are averaged, the validation ones are not."""
    import warnings

    import keras
    import numpy as np

    import hvdsync.keras as hvd
    from tests.keras_models import mlp, teacher_data
    hvd.init()
    model = mlp()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05),
                                   delay=dict(staleness=2, average_every=16))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    x, y = teacher_data(hvd.rank(), 6 * 16)
    seen, epoch_end = [], []

    def flat():
        return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])

    class Spy(keras.callbacks.Callback):
        def on_test_begin(self, logs=None):
            seen.append(flat())

        def on_epoch_end(self, epoch, logs=None):
            epoch_end.append(flat())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hist = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False,
                         validation_data=(x[:32], y[:32]) if hvd.rank() == 0 else None,
                         callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                    hvd.callbacks.FlushCallback(),
                                    hvd.callbacks.MetricAverageCallback(), Spy()])
    return dict(history=hist.history, seen=seen, epoch_end=epoch_end, final=flat(),
                warned=any("not logged on every rank" in str(w.message) for w in caught))


def test_one_rank_validating_does_not_hang():
    ranks = run_ranks(validate_on_rank_zero_only, np=2, timeout=300)
    assert len(ranks[0]["seen"]) == 2 and ranks[1]["seen"] == []
    for epoch in range(2):  # rank 0 validated the replicas every rank had (the epoch's flush)
        assert (ranks[0]["seen"][epoch] == ranks[1]["epoch_end"][epoch]).all()
        assert (ranks[0]["epoch_end"][epoch] == ranks[1]["epoch_end"][epoch]).all()
    assert (ranks[0]["final"] == ranks[1]["final"]).all()
    assert ranks[0]["history"]["loss"] == ranks[1]["history"]["loss"]  # averaged
    assert "val_loss" in ranks[0]["history"] and "val_loss" not in ranks[1]["history"]
    assert ranks[0]["warned"] and ranks[1]["warned"]
