"""Nothing from a checkpoint or a peer runs code (docs/checkpoints.md): torch checkpoints load
with ``weights_only=True`` (a crafted file is refused before anything in it runs, a real one
needs no flag), ``opt.state_dict()`` holds tensors and plain data only (torch's own
``torch.load`` default reads it), and Keras' per-rank state travels as arrays and JSON."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from torch import nn

from tests.models import MLP, teacher_batches

TECHNIQUES = {
    "plain": {},
    "clip": dict(clip=dict(ema=(0.9, 1.0), warmup=1, mode="local")),
    "threshold": dict(threshold=dict(threshold=0.6, max_skip=4)),
    "select": dict(select=dict(k=1, max_wait=3)),
    "lowrank": dict(lowrank=dict(rank=2, warmup_steps=1, min_compression=0)),
    "delay": dict(delay=dict(staleness=1, average_every=4)),
    "streaming": dict(delay="streaming"),
}


class RunsCode:
    """What a crafted checkpoint holds: unpickling it would create ``marker`` (any code)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def trained(options: dict):
    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), **options)
    for x, y in teacher_batches(0, 4):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return hvd, model, opt


def test_a_crafted_checkpoint_is_refused_without_running_its_code(tmp_path):
    hvd, model, opt = trained({})
    marker, path = tmp_path / "ran", str(tmp_path / "crafted.pt")
    torch.save({"model": model.state_dict(), "optimizer": None,
                "extra": RunsCode(str(marker))}, path)
    with pytest.raises(hvd.UntrustedCheckpoint, match=r"posix.system.*trusted=True"):
        hvd.load_checkpoint(path, model)
    assert not marker.exists()


def test_an_extra_of_ones_own_classes_loads_only_when_trusted(tmp_path):
    hvd, model, opt = trained({})
    path = str(tmp_path / "ckpt.pt")
    hvd.save_checkpoint(path, model, opt, extra={"when": np.datetime64("2026-11-29")})
    with pytest.raises(hvd.UntrustedCheckpoint, match="trusted=True"):
        hvd.load_checkpoint(path, model, opt)
    assert hvd.load_checkpoint(path, model, opt, trusted=True) == {
        "when": np.datetime64("2026-11-29")}


@pytest.mark.parametrize("technique", list(TECHNIQUES))
def test_real_checkpoints_need_no_flag_and_restore_the_same_state(technique, tmp_path):
    hvd, model, opt = trained(TECHNIQUES[technique])
    path = str(tmp_path / "ckpt.pt")
    hvd.save_checkpoint(path, model, opt, extra={"epoch": 3, "lr": [0.1, 0.01]})
    fresh_model, fresh_opt = trained(TECHNIQUES[technique])[1:]
    assert hvd.load_checkpoint(path, fresh_model, fresh_opt) == {"epoch": 3, "lr": [0.1, 0.01]}
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)
    from hvdsync.safety import checkpoint
    assert (checkpoint.shared_digest(fresh_opt._configured)
            == checkpoint.shared_digest(opt._configured))
    # the optimizer's own state_dict is tensors and plain data: torch's default reads it
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    torch.load(buf)  # weights_only=True


def test_files_written_before_with_numpy_arrays_still_load(tmp_path):
    """select='s hypernet state was numpy arrays (and numpy scalars) before state_dict()
    turned them into tensors: such a file loads with no flag."""
    from hvdsync.torch.saving import safe_load
    path = str(tmp_path / "old.pt")
    state = {"hypernet": {"w1": np.ones((3, 2)), "t": np.int64(4), "lr": np.float32(0.5)}}
    torch.save(state, path)
    loaded = safe_load(path)
    np.testing.assert_array_equal(loaded["hypernet"]["w1"], np.ones((3, 2)))
    assert loaded["hypernet"]["t"] == 4


def test_keras_per_rank_state_travels_as_arrays_and_json():
    from hvdsync.safety import checkpoint
    state = {"select": {"residual": {"0": np.arange(6.0).reshape(2, 3)}, "n": 3,
                        "names": ["a", "b"], "none": None}}
    back = checkpoint.state_from_bytes(checkpoint.state_bytes(state))
    np.testing.assert_array_equal(back["select"]["residual"]["0"], state["select"]["residual"]["0"])
    assert {k: v for k, v in back["select"].items() if k != "residual"} == {
        "n": 3, "names": ["a", "b"], "none": None}
    # a peer's bytes holding a pickled object are refused (allow_pickle=False)
    buf = io.BytesIO()
    np.savez(buf, **{checkpoint.STATE_KEY + "json": np.frombuffer(b"{}", np.uint8),
                     checkpoint.STATE_KEY + "0": np.array([RunsCode("/nonexistent")],
                                                          dtype=object)})
    with pytest.raises(ValueError, match="allow_pickle"):
        checkpoint.state_from_bytes(buf.getvalue())


# -- Horovod's broadcast recipe warns only where memory is really dropped ----------------------
def broadcast_warnings() -> dict:
    """Horovod's recipe -- broadcast_parameters and broadcast_optimizer_state right after
    the optimizer is built -- with ``delay="streaming"`` (per-rank parameters that equal the
    shared ones before any step), then again after ``select=`` trained (residuals held)."""
    import warnings

    import hvdsync.torch as hvd
    hvd.init()
    out = {}
    for case in ("streaming", "select"):
        torch.manual_seed(0)
        model = MLP()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(),
                                       **TECHNIQUES[case])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            out[f"{case} at the start"] = [str(w.message) for w in caught]
        for x, y in teacher_batches(hvd.rank(), 3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            out[f"{case} after steps"] = [str(w.message) for w in caught]
    return out


def test_the_broadcast_recipe_warns_only_where_memory_is_dropped():
    from tests.models import run_job
    for rank, out in enumerate(run_job(broadcast_warnings, 2, launcher="torchrun")):
        assert out["streaming at the start"] == [] and out["select at the start"] == [], out
        for case, memory in (("streaming", "delay: outer_residual"), ("select", "select: residual")):
            dropped = out[f"{case} after steps"]  # what was really held, and how much
            assert len(dropped) == 1 and f"this rank dropped {memory} (" in dropped[0], out
            assert " B)" in dropped[0] or " KB)" in dropped[0], dropped
