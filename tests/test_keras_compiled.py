"""threshold= and select= compiled into Keras' train function (hvdsync.keras.compiled) against
the same techniques run eagerly through the step pipeline (``HVDSYNC_KERAS_PIPELINE=1``) and
the compiled step run eagerly (``run_eagerly=True``): the same layers sent at every step and
the same weights, on 2 and 3 real ranks with different data per rank (float64)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.keras_models import KERAS_NP, KERAS_NP_IDS

MODES = ("compiled", "run_eagerly", "pipeline")

CASES = {
    "threshold": (dict(threshold=dict(threshold=0.6, max_skip=3)), "momentum", 0.05),
    "threshold_relative": (dict(threshold=dict(threshold=0.05, relative=True, max_skip=4)),
                           "adam", 0.01),
    "threshold_global_clip": (dict(threshold=dict(threshold=0.5, scope="global", max_skip=2),
                                   clip=dict(max_norm=0.3)), "sgd", 0.1),
    "select_hypernet": (dict(select=dict(k=1, max_wait=2)), "momentum", 0.05),
    "select_budget": (dict(select=dict(budget=0.4, selector="norm")), "adam", 0.01),
    "select_clip_global": (dict(select=dict(k=2, selector="random"),
                                clip=dict(max_norm=0.2, mode="global")), "sgd", 0.1),
}
STEPS, BATCH = 12, 16


def compiled_case(options: dict, opt_name: str, lr: float) -> dict:
    """One case in each mode: per mode, the layers sent per step, the weights after every
    step, whether the graph path ran, and the final technique state's per-rank keys."""
    import os

    import keras
    import hvdsync.keras as hvd
    from tests.keras_models import (Recorder, make_optimizer, mlp, one_tensorflow_thread,
                                    teacher_data)
    hvd.init()
    one_tensorflow_thread()
    x, y = teacher_data(hvd.rank(), STEPS * BATCH)
    out = {}
    for mode in MODES:
        os.environ["HVDSYNC_KERAS_PIPELINE"] = "1" if mode == "pipeline" else "0"
        model = mlp(dtype="float64")
        opt = hvd.DistributedOptimizer(make_optimizer(opt_name, lr), **options)
        model.compile(optimizer=opt, run_eagerly=mode == "run_eagerly",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rec = Recorder.make(True)
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), rec])
        out[mode] = dict(sent=rec.sent, weights=rec.weights, graph=opt._hv.graph_path,
                         total=opt.stats.total.as_dict())
    os.environ.pop("HVDSYNC_KERAS_PIPELINE")
    return out


def shared_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared rank job (tests/conftest.py)."""
    return ({name: (compiled_case, *case) for name, case in CASES.items()}
            if np_ in KERAS_NP else {})


@pytest.fixture(scope="module", params=KERAS_NP, ids=KERAS_NP_IDS)
def runs(request, shared_job):
    return shared_job(request.module, request.param)


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_deciders_equal_the_step_pipeline(runs, case):
    for r in runs[case]:
        assert r["compiled"]["graph"] and r["run_eagerly"]["graph"]
        assert not r["pipeline"]["graph"]
        ref = r["pipeline"]
        sent = ref["sent"]
        flat = [n for step in sent for n in step]
        assert 0 < len(flat) < len(sent) * 3, "expected a mix of sent and kept layers"
        for mode in ("compiled", "run_eagerly"):
            got = r[mode]
            assert got["sent"] == sent, mode
            for t, (a, b) in enumerate(zip(got["weights"], ref["weights"])):
                for k in b:
                    np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-9,
                                               err_msg=f"{mode} step {t} {k}")
            for k in ("bytes_sent", "bytes_dense", "layers_sent", "layers_skipped"):
                assert got["total"][k] == ref["total"][k], (mode, k)
    # and every rank took the same decisions
    for other in runs[case][1:]:
        assert other["compiled"]["sent"] == runs[case][0]["compiled"]["sent"]
