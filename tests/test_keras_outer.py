"""``delay=``'s outer synchronization in Keras 3 ``model.fit`` (2 and 3 real ranks): the
compressed exchanges run through Keras' background thread, ``FlushCallback`` leaves identical
replicas (hvdsync/techniques/outer/, docs/delay.md). That the same float64 model gives torch's result
step for step: tests/test_adapters_agree.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.keras_models import KERAS_NP, fit_body

STREAMING = dict(exchange_gradients=False, average_every=4, fragments=2, overlap=1, mix=0.5,
                 outer_lr=0.7, outer_momentum=0.9)


def int8_streaming_fit() -> dict:
    return fit_body(dict(delay=dict(STREAMING, compress="int8")), "adam", 0.01, 48, 16,
                    callbacks=("broadcast", "flush"), evaluate=True)


def shared_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared rank job (tests/conftest.py)."""
    return {"int8_streaming": (int8_streaming_fit,)} if np_ in KERAS_NP else {}


@pytest.mark.parametrize("np_", KERAS_NP)
def test_compressed_exchange_and_flush_callback(request, shared_job, np_):
    """int8 streaming through fit, FlushCallback at the end: replicas identical, the bytes
    are int8's (one byte per value plus a scale per 1024), and it learns."""
    runs = shared_job(request.module, np_)["int8_streaming"]
    for r in runs[1:]:
        for name, w in r["final"].items():
            np.testing.assert_array_equal(w, runs[0]["final"][name])
    total = runs[0]["stats"]["total"]
    sizes = [12 * 16 + 16 + 16 * 16 + 16, 16 * 4 + 4]
    per = [n + 4 for n in sizes]  # one scale each: both fragments are under 1024 values
    # 48 steps: fragment 0 after steps 2, 6, ..., 46 (12), fragment 1 after 4, ..., 44 (11;
    # the one after step 48 counts with step 49), then flush averages in float32
    assert total["outer_bytes"] == 12 * per[0] + 11 * per[1], total
    assert runs[0]["test_accuracy"] > 0.6, runs[0]["test_accuracy"]
