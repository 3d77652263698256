"""The wire codecs (:mod:`hvdsync.core.wire`): each encoding's round trip within its bound,
the two adapters' primitives giving the same parts and values, and an encoding that only a test
defines -- one class registered in :data:`~hvdsync.core.wire.CODECS` -- carrying ``delay=``'s
outer exchange on simulated ranks (docs/internals.md, "Adding an encoding"). Then the codecs
of techniques: ``lowrank=``'s two-round factors and ``sparse=``'s rows."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pytest
import torch
from torch import nn

from hvdsync.core.wire import CODECS, Codec
from hvdsync.testing import run_threads
from tests.models import MLP, teacher_batches

SIZE = 3  # ranks whose parts a gathered codec averages
SHAPES = [(5, 7), (300,), (2, 3, 4), (1500,)]  # more than one int8 chunk, a short tail


def tensors(seed: int) -> list[torch.Tensor]:
    """Float32 tensors of :data:`SHAPES`, spread over a few orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 10.0 ** (i - 2) for i, s in enumerate(SHAPES)]


def torch_ops():
    from hvdsync.torch.ops import TorchOps
    return TorchOps()


def on_the_wire(codec: Codec, per_rank: list[list]) -> list:
    """What ``codec.collective`` over the ranks' parts gives every rank (torch tensors): the
    mean of each part (allreduce, Horovod's Average) or the parts concatenated in rank order
    (allgather)."""
    if codec.collective == "allreduce":
        return [sum(p[i].double() for p in per_rank).div(len(per_rank)).to(per_rank[0][i].dtype)
                for i in range(len(per_rank[0]))]
    return [torch.cat([p[i] for p in per_rank]) for i in range(len(per_rank[0]))]


#: codec name -> the largest error of a round trip, relative to the largest magnitude among the
#: 1024 values around it (int8's block: half a step of its scale)
ROUND_TRIP = {"none": 0.0, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8, "int8": 0.5 / 127}


@pytest.mark.parametrize("name", list(CODECS))
def test_round_trip_within_the_encodings_bound(name):
    codec, ops = CODECS[name], torch_ops()
    like = tensors(0)
    back = codec.decode(ops, *codec.encode(ops, like))
    assert [(b.shape, b.dtype) for b in back] == [(t.shape, t.dtype) for t in like]
    flat, flat_back = torch.cat([t.flatten() for t in like]), torch.cat([b.flatten() for b in back])
    chunk = CODECS["int8"].chunk
    for i in range(0, flat.numel(), chunk):
        error = (flat_back[i:i + chunk] - flat[i:i + chunk]).abs().max().item()
        assert error <= ROUND_TRIP[name] * flat[i:i + chunk].abs().max().item(), (name, i)
    assert codec.exact == (name == "none")
    assert name == "none" or not torch.equal(flat, flat_back)  # it did encode


@pytest.mark.parametrize("name", list(CODECS))
def test_average_of_ranks_is_the_average_of_their_decoded_tensors(name):
    codec, ops = CODECS[name], torch_ops()
    ranks = [tensors(r) for r in range(SIZE)]
    received = on_the_wire(codec, [codec.encode(ops, ts)[0] for ts in ranks])
    mean = codec.average(ops, received, SIZE, codec.encode(ops, ranks[0])[1])
    for i, m in enumerate(mean):
        want = sum(codec.decode(ops, *codec.encode(ops, ts))[i].double() for ts in ranks) / SIZE
        scale = max(ts[i].abs().max().item() for ts in ranks)
        # an allreduce sums in the parts' precision (fp16's float16 sum): one more rounding
        slack = 2.0 ** -10 if name == "fp16" else 1e-6
        assert (m.double() - want).abs().max().item() <= slack * scale, name


@pytest.mark.parametrize("name", [n for n in CODECS if n != "none"])
def test_a_nonfinite_value_shows_after_decoding(name):
    codec, ops = CODECS[name], torch_ops()
    like = tensors(1)
    like[1][17] = float("nan")
    back = codec.decode(ops, *codec.encode(ops, like))
    assert not torch.isfinite(back[1]).all(), name


@pytest.mark.parametrize("name", list(CODECS))
def test_torch_and_keras_primitives_give_the_same_parts_and_values(name):
    """Every codec runs over both adapters' primitives: the same wire parts bit for bit, the
    same decoded and averaged values to 1e-9."""
    import tensorflow as tf

    from hvdsync.keras.ops import KerasOps
    codec, t_ops, k_ops = CODECS[name], torch_ops(), KerasOps()
    ranks = [tensors(r) for r in range(SIZE)]
    as_tf = [[tf.constant(t.numpy()) for t in ts] for ts in ranks]
    t_parts = [codec.encode(t_ops, ts)[0] for ts in ranks]
    k_parts = [codec.encode(k_ops, ts)[0] for ts in as_tf]
    for tp, kp in zip(t_parts, k_parts):
        assert [p.numpy().tobytes() for p in tp] == [np.asarray(p).tobytes() for p in kp], name
    t_back = codec.decode(t_ops, *codec.encode(t_ops, ranks[0]))
    k_back = codec.decode(k_ops, *codec.encode(k_ops, as_tf[0]))
    received = on_the_wire(codec, t_parts)
    t_mean = codec.average(t_ops, received, SIZE, ranks[0])
    k_mean = codec.average(k_ops, [tf.constant(p.numpy()) for p in received], SIZE, as_tf[0])
    for a, b in zip(t_back + t_mean, k_back + k_mean):
        np.testing.assert_allclose(np.asarray(b), a.numpy(), rtol=0, atol=1e-9)


class HalfBitsGathered(Codec):
    """A test's own encoding: float16 bits as int16, gathered, averaged in float32 (fp16's
    bytes without its float16 sum). Nothing but this class and its line in ``CODECS``."""

    name, collective = "fp16_gathered", "allgather"

    def encode(self, ops: Any, tensors: Sequence[Any]) -> tuple[list, Any]:
        return [ops.bitcast(ops.cast(ops.flat(tensors), "float16"), "int16")], tensors

    def _values(self, ops: Any, bits: Any) -> Any:
        return ops.cast(ops.bitcast(bits, "float16"), "float32")

    def decode(self, ops: Any, parts: Sequence[Any], ctx: Any) -> list:
        return ops.unflat(self._values(ops, parts[0]), ctx)

    def average(self, ops: Any, received: Sequence[Any], size: int, ctx: Any) -> list:
        return ops.average_rows(ops.rows(self._values(ops, received[0]), size), ctx)


STEPS, K, FRAGMENTS = 40, 4, 2


def trained_with(compress: str) -> dict:
    """On a rank: 40 steps of the MLP with K=4 outer averaging in 2 fragments over
    ``compress``; the loss at the start and end, the outer bytes, every rank's parameters
    after flush()."""
    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = MLP()
    opt = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
        delay=dict(exchange_gradients=False, average_every=K, fragments=FRAGMENTS,
                   compress=compress))
    losses = []
    for x, y in teacher_batches(hvd.rank(), STEPS):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    outer_bytes = opt.stats.as_dict()["total"]["outer_bytes"]
    opt.flush()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = hvd.allgather(params.unsqueeze(0), name="codec.params")
    return dict(first=losses[0], last=sum(losses[-5:]) / 5, outer_bytes=outer_bytes,
                n_params=params.numel(), spread=(gathered - gathered[0]).abs().max().item())


def test_a_new_encoding_is_one_class(monkeypatch):
    monkeypatch.setitem(CODECS, HalfBitsGathered.name, HalfBitsGathered())
    ours = run_threads(trained_with, 2, args=(HalfBitsGathered.name,))
    fp16 = run_threads(trained_with, 2, args=("fp16",))
    for r, h in zip(ours, fp16):
        assert r["spread"] == 0.0, r  # replicas identical after flush()
        assert r["last"] < 0.7 * r["first"], r  # it trains
        # two bytes a value, as fp16's: the same exchanges, every value in one of them
        assert r["outer_bytes"] == h["outer_bytes"] > 0, (r, h)
        exchanges = STEPS // K  # per fragment, give or take the last one in flight
        assert r["outer_bytes"] <= 2 * r["n_params"] * exchanges, r


def test_an_unknown_encoding_is_refused_at_construction():
    from tests.models import assert_construction_fails
    assert_construction_fails(ValueError, "compress", delay=dict(compress="fp8"))


# -- the codecs of techniques: lowrank='s factors (two rounds), sparse='s rows --------------------
def low_rank_ranks(seed: int, rank: int = 2) -> tuple[list[list], list]:
    """Per rank, matrices ``U V_r^T`` of rank ``rank`` sharing ``U`` (their average is of that
    rank too), and the Q each starts from (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(12, 9), (20, 6)]
    us = [torch.randn(n, rank, generator=g) for n, _ in shapes]
    ranks = [[u @ torch.randn(m, rank, generator=g).T for u, (_, m) in zip(us, shapes)]
             for _ in range(SIZE)]
    return ranks, [torch.randn(m, rank, generator=g) for _, m in shapes]


def factors_on_the_wire(ops: Any, per_rank: list[list], start: list) -> tuple[list, list]:
    """Both rounds of lowrank's codec over the ranks (each round's allreduce a mean):
    every rank's average, and each rank's residual."""
    from hvdsync.techniques.lowrank.codec import FACTORS
    encoded = [FACTORS.encode(ops, ms, start) for ms in per_rank]
    p_avg = [sum(parts[i] for parts, _ in encoded) / len(per_rank) for i in range(len(start))]
    second = [FACTORS.next_round(ops, p_avg, ctx) for _, ctx in encoded]
    q_avg = [sum(parts[i] for parts, _ in second) / len(per_rank) for i in range(len(start))]
    averages = [FACTORS.average(ops, q_avg, len(per_rank), ctx) for _, ctx in second]
    return averages, [FACTORS.residual(ops, a, ctx) for a, (_, ctx) in zip(averages, second)]


def test_lowrank_factors_give_a_low_rank_average_exactly_and_owe_the_rest():
    """Two rounds of the factors: an average of rank <= r comes back as it is on every rank
    (the same bits), and what the ranks owe sums to zero (error feedback loses nothing)."""
    per_rank, start = low_rank_ranks(0)
    averages, residuals = factors_on_the_wire(torch_ops(), per_rank, start)
    for i in range(len(start)):
        mean = sum(ms[i] for ms in per_rank) / SIZE
        assert all(torch.equal(a[i], averages[0][i]) for a in averages)
        assert (averages[0][i] - mean).abs().max().item() <= 1e-4 * mean.abs().max().item()
        owed = sum(r[i] for r in residuals)
        assert owed.abs().max().item() <= 1e-4 * mean.abs().max().item()


def test_lowrank_factors_send_the_factors_bytes():
    """What goes on the wire is the factors: ``n x r`` then ``m x r`` per matrix."""
    from hvdsync.techniques.lowrank.codec import FACTORS
    ops = torch_ops()
    per_rank, start = low_rank_ranks(1)
    parts, ctx = FACTORS.encode(ops, per_rank[0], start)
    assert [tuple(p.shape) for p in parts] == [(12, 2), (20, 2)]
    parts, _ = FACTORS.next_round(ops, parts, ctx)
    assert [tuple(p.shape) for p in parts] == [(9, 2), (6, 2)]
    assert FACTORS.rounds == 2 and FACTORS.collective == "allreduce"


def test_lowrank_factors_torch_and_keras_agree():
    """lowrank's codec over both adapters' primitives: the same averages and residuals to
    1e-9."""
    import tensorflow as tf

    from hvdsync.keras.ops import KerasOps
    per_rank, start = low_rank_ranks(2)
    t_avg, t_res = factors_on_the_wire(torch_ops(), [[m.double() for m in ms] for ms in per_rank],
                                       [q.double() for q in start])
    k_avg, k_res = factors_on_the_wire(
        KerasOps(), [[tf.constant(m.double().numpy()) for m in ms] for ms in per_rank],
        [tf.constant(q.double().numpy()) for q in start])
    for a, b in zip([x for r in t_avg + t_res for x in r], [x for r in k_avg + k_res for x in r]):
        np.testing.assert_allclose(np.asarray(b), a.numpy(), rtol=0, atol=1e-9)


def sparse_ranks(seed: int) -> list[torch.Tensor]:
    """Per rank, a coalesced row-sparse gradient of a 10 x 3 table (rows overlap)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(SIZE):
        rows = torch.randperm(10, generator=g)[:4 + r].sort().values
        out.append(torch.sparse_coo_tensor(rows.unsqueeze(0), torch.randn(len(rows), 3,
                                                                          generator=g),
                                           (10, 3), check_invariants=True).coalesce())
    return out


@pytest.mark.parametrize("route", ["gather", "dense"])
def test_sparse_rows_average_to_the_dense_average(route):
    """Each of sparse='s row codecs: what the collective gives for every rank's rows is the
    average of the ranks' gradients, as a coalesced sparse gradient; decoding this rank's
    parts gives its gradient back."""
    from hvdsync.techniques.sparse.codec import ROUTE_CODECS
    from hvdsync.torch.compression import Compression
    from hvdsync.torch.rows import TorchRows
    rows, codec = TorchRows(Compression.none), ROUTE_CODECS[route]((10, 3), 1)
    grads = sparse_ranks(0)
    encoded = [codec.encode(rows, [g]) for g in grads]
    received = ([torch.cat([parts[0] for parts, _ in encoded])] if codec.collective == "allgather"
                else [sum(parts[0] for parts, _ in encoded)])
    assert codec.collective == {"gather": "allgather", "dense": "sum"}[route]
    mean, = codec.average(rows, received, SIZE, encoded[0][1])
    assert mean.is_sparse and mean.is_coalesced()
    want = sum(g.to_dense() for g in grads) / SIZE
    assert torch.allclose(mean.to_dense(), want, atol=1e-6)
    assert mean._nnz() == len(set().union(*(g._indices()[0].tolist() for g in grads)))
    back, = codec.decode(rows, *encoded[0])
    assert torch.equal(back.to_dense(), grads[0].to_dense())
