"""The performance model and ``python -m hvdsync.tools.advise`` (no ranks, in seconds): the collective
formulas, the byte model against what the bench bed measured, the shape of the predictions,
and the advisor on presets, on sizes alone and on a demo model (docs/at-scale.md)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdsync.tools import advise, perfmodel
from hvdsync.tools.perfmodel import Cluster, Constants, LayerSize, ModelSizes

ROOT = Path(__file__).resolve().parents[1]
PLAIN = Constants(link_efficiency=1.0, collective_s=0.0, overlap=0.0, layer_s=0.0,
                  decider_s=0.0, delay_s=0.0, ddp_s=0.0, cast_s=0.0, norm_s=0.0,
                  accumulate_s=0.0, matrix_s=0.0, step_s=0.0)
MB = 1 << 20


def _model(params_per_layer=(MB, MB), compute_s=0.1) -> ModelSizes:
    layers = tuple(LayerSize(f"l{i}", p, ((1024, p // 1024),)) for i, p in
                   enumerate(params_per_layer))
    return ModelSizes(layers, compute_s / 3, 2 * compute_s / 3)


def test_ring_allreduce_moves_2_n_minus_1_over_n_of_the_bytes():
    c = Cluster(ranks=4, bandwidth_gbit=8.0, latency_us=0.0, algorithm="ring")
    # 8 Gbit/s = 1e9 bytes/s; 4 ranks: 2 * 3/4 of 1e9 bytes -> 1.5 s
    assert perfmodel.allreduce_s(1e9, c, PLAIN) == pytest.approx(1.5)
    assert perfmodel.allreduce_s(1e9, Cluster(ranks=1, bandwidth_gbit=8.0), PLAIN) == 0.0
    lat = Cluster(ranks=4, bandwidth_gbit=8.0, latency_us=100.0, algorithm="ring")
    assert perfmodel.allreduce_s(0.0, lat, PLAIN) == 0.0
    assert perfmodel.allreduce_s(8.0, lat, PLAIN) == pytest.approx(6 * 100e-6, rel=1e-3)


def test_tree_wins_small_messages_ring_large_ones_and_auto_takes_the_faster():
    kw = dict(ranks=8, bandwidth_gbit=100.0, latency_us=20.0)
    ring, tree, auto = (Cluster(**kw, algorithm=a) for a in ("ring", "tree", "auto"))
    small, large = 4e3, 4e9
    assert perfmodel.allreduce_s(small, tree, PLAIN) < perfmodel.allreduce_s(small, ring, PLAIN)
    assert perfmodel.allreduce_s(large, ring, PLAIN) < perfmodel.allreduce_s(large, tree, PLAIN)
    for b in (small, large):
        assert perfmodel.allreduce_s(b, auto, PLAIN) == pytest.approx(min(
            perfmodel.allreduce_s(b, ring, PLAIN), perfmodel.allreduce_s(b, tree, PLAIN)))


def test_a_fast_link_inside_the_node_shortens_the_allreduce():
    flat = Cluster(ranks=64, bandwidth_gbit=10.0, ranks_per_node=1, algorithm="ring")
    nodes = Cluster(ranks=64, bandwidth_gbit=10.0, ranks_per_node=8, algorithm="ring")
    assert perfmodel.allreduce_s(1e9, nodes, PLAIN) < perfmodel.allreduce_s(1e9, flat, PLAIN) / 4


def test_bad_input_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="adapter must be one of"):
        ModelSizes((), 0.1, 0.2, adapter="jax")
    with pytest.raises(ValueError, match="multiple of"):
        Cluster(ranks=6, bandwidth_gbit=1.0, ranks_per_node=4)
    with pytest.raises(ValueError, match="algorithm"):
        Cluster(ranks=2, bandwidth_gbit=1.0, algorithm="butterfly")
    with pytest.raises(ValueError, match="unknown technique"):
        perfmodel.predict("adasum", _model(), Cluster(ranks=2, bandwidth_gbit=1.0))


def test_bytes_per_technique():
    m = _model()
    c = Cluster(ranks=8, bandwidth_gbit=1.0)
    dense = m.params * 4
    by = {p.technique: p.bytes_per_step for p in perfmodel.predict_all(m, c, PLAIN)}
    assert by["horovod"] == dense and by["hvdsync"] == dense
    assert by["horovod fp16"] == dense / 2
    assert by["hvdsync select"] == pytest.approx(dense / 2)  # k = 0.5
    # rank 2 factors of two 1024 x 1024 matrices: P and Q, 2 * 1024 values each
    assert by["hvdsync lowrank"] == 2 * 2 * (2 * 1024) * 4
    # int8 fragments: 4 of them, one every 8 / 4 steps
    assert by["hvdsync streaming"] == pytest.approx(m.params / 8)
    assert by["ddp post-local sgd"] == pytest.approx(dense / 32)


def test_compositions_send_the_compressed_share():
    """``lowrank=`` under a decider: the layers that go, compressed; inside ``delay=``: every
    step's factors, plus the parameters averaged every K steps."""
    m = _model()
    c = Cluster(ranks=8, bandwidth_gbit=1.0)
    factors = 2 * 2 * (2 * 1024) * 4
    decided = perfmodel.predict("hvdsync threshold", m, c, PLAIN, lowrank=2, send_fraction=0.25)
    assert decided.bytes_per_step == pytest.approx(0.25 * factors)
    alone = perfmodel.predict("hvdsync threshold", m, c, PLAIN, lowrank=2, send_fraction=1.0)
    assert decided.step_s < alone.step_s
    inside = perfmodel.predict("hvdsync delay", m, c, PLAIN, lowrank=2, staleness=1)
    assert inside.bytes_per_step == pytest.approx(factors + m.params * 4 / 32)


def test_delay_is_paced_by_the_slower_of_link_and_compute():
    """Every step of ``delay=`` puts its whole exchange on the link: the staleness hides the
    exchange behind the next steps' compute, it does not divide it."""
    c = Cluster(ranks=2, bandwidth_gbit=0.1)
    for compute_s in (0.001, 10.0):  # link-bound, compute-bound
        m = _model(compute_s=compute_s)
        link = sum(perfmodel.allreduce_s(layer.params * 4, c, PLAIN) for layer in m.layers)
        for staleness in (1, 4):
            p = perfmodel.predict("hvdsync delay", m, c, PLAIN, staleness=staleness,
                                  average_every=0)
            assert p.step_s == pytest.approx(max(link, compute_s)), (compute_s, staleness)


def test_a_runs_plain_first_steps_are_averaged_in():
    """``warmup_share``: that share of the steps costs what a plain step costs (lowrank='s
    warm-up); a technique without a plain start is unchanged."""
    c, m = Cluster(ranks=2, bandwidth_gbit=0.1), _model()
    steady = perfmodel.predict("hvdsync lowrank", m, c, PLAIN)
    plain = perfmodel.predict("hvdsync", m, c, PLAIN)
    run = perfmodel.predict("hvdsync lowrank", m, c, PLAIN, warmup_share=0.25)
    for field in ("bytes_per_step", "step_s", "collectives"):
        assert getattr(run, field) == pytest.approx(
            0.75 * getattr(steady, field) + 0.25 * getattr(plain, field)), field
    assert steady.bytes_per_step < plain.bytes_per_step / 10
    same = perfmodel.predict("hvdsync", m, c, PLAIN, warmup_share=0.25)
    assert same.bytes_per_step == plain.bytes_per_step and same.step_s == plain.step_s


def test_keras_decider_costs_are_the_overhead_benchs():
    """The compiled Keras deciders' constants are what the committed overhead runs give (a
    line through two widths), and a Keras model is charged them, a torch one the host's."""
    from benchmarks.bench_perfmodel import keras_decider_costs
    fixed, per_param = keras_decider_costs()
    c = perfmodel.CALIBRATED
    assert c.keras_decider_s == pytest.approx(fixed, rel=0.02)
    assert c.keras_keep_s == pytest.approx(per_param, rel=0.02)
    cl = Cluster(ranks=2, bandwidth_gbit=0.1)
    torch_model = _model()
    keras_model = ModelSizes(torch_model.layers, torch_model.forward_s, torch_model.backward_s,
                             adapter="keras")
    host = perfmodel.predict("hvdsync threshold", torch_model, cl, c, send_fraction=1.0)
    graph = perfmodel.predict("hvdsync threshold", keras_model, cl, c, send_fraction=1.0)
    plain = perfmodel.predict("hvdsync", torch_model, cl, c)
    params = torch_model.params
    # the control round: a float32 value per layer (float32 gradients)
    control = perfmodel.allreduce_s(4 * len(torch_model.layers), cl, c)
    assert graph.step_s - plain.step_s == pytest.approx(
        c.keras_decider_s + c.keras_keep_s * params + control)
    assert host.step_s - plain.step_s == pytest.approx(
        c.decider_s + c.accumulate_s * params + control)


@pytest.mark.parametrize("method, technique, rel", [
    ("hvdsync lowrank", "hvdsync lowrank", 0.01),
    # each seed ran its own number of steps: the mean of bytes/steps is not bytes/mean steps;
    # a short run (450 steps) averages a whole number of times (14, not 13.75)
    ("ddp post-local sgd", "ddp post-local sgd", 0.04),
])
def test_runs_with_a_plain_start_measured_what_the_model_averages(method, technique, rel):
    """The LM's bench runs: 10 plain steps (lowrank='s warm-up, post-local SGD's synchronous
    start) counted in the run's bytes per step."""
    from benchmarks.workloads import WORKLOADS
    sizes = ModelSizes(perfmodel.layers_of(WORKLOADS["stdlib_lm"].make_model(False)), 0.01,
                       0.02)
    runs = {}
    for path in sorted((ROOT / "benchmarks" / "results").glob("suite*.json")):
        for cell, c in json.loads(path.read_text())["cells"].items():
            if cell.startswith("stdlib_lm,") and method in c["methods"]:
                nodes = re.search(r"(\d+) nodes x (\d+) ranks", cell)
                ranks = (int(nodes.group(1)) * int(nodes.group(2)) if nodes
                         else int(re.search(r"(\d+) ranks", cell).group(1)))
                runs[path.name] = c["methods"][method], ranks
    assert runs
    for name, (run, ranks) in runs.items():
        p = perfmodel.predict(technique, sizes, Cluster(ranks=ranks, bandwidth_gbit=0.1),
                              warmup_share=10 / run["steps"])
        assert p.bytes_per_step == pytest.approx(run["bytes_per_step"], rel=rel), name


@pytest.mark.parametrize("workload, method, technique, settings", [
    ("stdlib_lm", "horovod", "horovod", {}),
    ("stdlib_lm", "horovod fp16", "horovod fp16", {}),
    ("stdlib_lm", "ddp+powersgd", "ddp+powersgd", {}),
    ("stdlib_lm", "torchft streaming diloco", "hvdsync streaming",
     {"outer": dict(average_every=8, fragments=4, overlap=1, value_bytes=4)}),
    ("teacher_cnn", "horovod", "horovod", {}),
    ("teacher_cnn", "ddp+powersgd", "ddp+powersgd", {}),
    ("digits_mlp", "hvdsync", "hvdsync", {}),
    ("zipf_embedding", "hvdsync sparse", "hvdsync sparse", {}),
])
def test_the_byte_model_matches_what_the_bench_bed_measured(workload, method, technique,
                                                          settings):
    """Bytes per rank per step as the committed bench results measured them (the embedding's
    touched rows counted from one batch of the workload: within 10 %, the rest exact)."""
    import torch

    from benchmarks.workloads import WORKLOADS
    measured = {}
    for path in sorted((ROOT / "benchmarks" / "results").glob("suite*.json")):
        for cell, c in json.loads(path.read_text())["cells"].items():
            if cell.startswith(workload + ",") and method in c["methods"]:
                measured[path.name] = c["methods"][method]["bytes_per_step"]
    assert measured, (workload, method)
    w = WORKLOADS[workload]
    torch.manual_seed(0)
    x, _ = w.batches(0, 1, 0)()
    rows = {"embedding": int(torch.unique(x).numel())} if w.has_sparse else {}
    sizes = ModelSizes(perfmodel.layers_of(w.make_model(False), rows), 0.01, 0.02)
    p = perfmodel.predict(technique, sizes, Cluster(ranks=2, bandwidth_gbit=0.1), **settings)
    for name, nbytes in measured.items():
        assert p.bytes_per_step == pytest.approx(nbytes, rel=0.10 if rows else 1e-6), name


def test_a_slower_link_costs_more_and_compression_gains_more():
    m = _model((4 * MB,) * 8, compute_s=0.05)

    def step(t: str, gbit: float) -> float:
        return perfmodel.predict(t, m, Cluster(ranks=16, bandwidth_gbit=gbit),
                                 advise.GPU_CLUSTER).step_s
    assert step("horovod", 1.0) > step("horovod", 10.0) > step("horovod", 100.0)
    for t in ("hvdsync lowrank", "hvdsync streaming"):  # (hidden behind compute: equal)
        assert step(t, 0.1) > step(t, 1.0) >= step(t, 10.0) >= step(t, 100.0)
    gain = {g: step("hvdsync lowrank", g) / step("horovod", g) for g in (1.0, 100.0)}
    assert gain[1.0] < gain[100.0]


def test_the_advisor_picks_compression_on_a_slow_link_and_horovod_on_a_fast_one():
    m = _model((4 * MB,) * 8, compute_s=0.2)
    slow = advise.advise(m, Cluster(ranks=32, bandwidth_gbit=0.1), "transformer",
                         advise.GPU_CLUSTER)
    fast = advise.advise(_model((MB // 16,) * 2, compute_s=0.2),
                         Cluster(ranks=8, bandwidth_gbit=400.0), "transformer",
                         advise.GPU_CLUSTER)
    assert slow["recommended"] != "horovod"
    assert fast["recommended"] in ("horovod", "horovod fp16", "hvdsync")
    for result in (slow, fast):
        assert "communication is" in result["reason"]
        table = advise.format_table(result)
        assert all(r["prediction"].technique in table for r in result["rows"])


def test_presets_have_the_sizes_they_are_named_for():
    p = advise.presets(tokens=16384, images=256)
    params = {k: sum(layer.params for layer in v.layers) for k, v in p.items()}
    assert params["gpt-125m"] == pytest.approx(125e6, rel=0.05)
    assert params["gpt-1.3b"] == pytest.approx(1.3e9, rel=0.1)
    assert params["resnet50"] == pytest.approx(25.6e6, rel=0.02)


@pytest.mark.parametrize("args", [
    ["--preset", "gpt-1.3b", "--ranks", "512", "--ranks-per-node", "8", "--bandwidth", "10"],
    ["--params", "1e8", "--layers", "40", "--compute-ms", "100", "--ranks", "8",
     "--bandwidth", "1"],
    ["--model", "examples.torch.train_teacher:student", "--input-shape", "64,32", "--measure",
     "--ranks", "4", "--bandwidth", "0.1", "--family", "mlp"],
    ["--model", "tests.keras_models:mlp", "--input-shape", "16,12", "--measure", "--ranks", "4",
     "--bandwidth", "0.1", "--family", "mlp"],
])
def test_python_m_hvdsync_advise_runs_offline_in_seconds(args):
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "hvdsync.tools.advise", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "recommended:" in out.stdout and "horovod" in out.stdout
    # every answer ends with the line that turns the choice on
    assert out.stdout.splitlines()[-1].startswith("    opt = hvd.DistributedOptimizer(opt, "), \
        out.stdout
    assert time.monotonic() - start < 60


SPARSE = ["--model", "tests.models:sparse_embedding", "--compute-ms", "20", "--ranks", "8",
          "--bandwidth", "0.1"]


@pytest.mark.parametrize("rows", [["--input-shape", "64,32"], ["--embedding-rows", "500"],
                                  ["--embedding-rows", "0=500"]])
def test_the_advisor_recommends_sparse_for_a_large_sparse_embedding(capsys, rows):
    """A 200k-row nn.EmbeddingBag(sparse=True) at 100 Mbit/s: its rows (given, or estimated
    from a batch's shape) make sparse= the answer, with the line to paste."""
    advise.main(SPARSE + rows)
    out = capsys.readouterr().out
    assert "recommended: hvdsync sparse" in out, out
    assert out.splitlines()[-1].endswith("named_parameters=model.named_parameters(), "
                                         "sparse=True)"), out


def test_the_advisor_says_why_sparse_cannot_apply(capsys):
    advise.main(["--model", "tests.models:dense_embedding"] + SPARSE[2:]
                + ["--input-shape", "64,32"])
    out = capsys.readouterr().out
    assert "note: 0: an embedding with sparse=False has dense gradients" in out, out
    assert "recommended: hvdsync sparse" not in out
    advise.main(SPARSE)  # no rows given and no batch shape: it says what to give
    assert "give --embedding-rows" in capsys.readouterr().out


def test_the_advisor_says_why_a_faster_row_was_passed_over(capsys):
    advise.main(["--preset", "gpt-125m", "--ranks", "64", "--ranks-per-node", "8",
                 "--bandwidth", "100"])
    out = capsys.readouterr().out
    recommended = re.search(r"^recommended: (.+?) --", out, re.M).group(1)
    passed = re.findall(r"^  passed over: (.+?) \(", out, re.M)
    assert passed and recommended not in passed, out
    assert "ddp+powersgd" in passed and all(": " in line for line in out.splitlines()
                                            if line.startswith("  passed over:"))


def test_fewer_steps_than_horovod_on_one_workload_is_not_credited():
    m = _model((MB,) * 4, compute_s=0.05)
    r = advise.advise(m, Cluster(ranks=4, bandwidth_gbit=0.1), "mlp", advise.GPU_CLUSTER)
    clip = next(x for x in r["rows"] if x["prediction"].technique == "hvdsync clip")
    assert clip["steps_factor"] < 1  # as measured (digits)
    assert clip["time_to_target"] == pytest.approx(clip["prediction"].step_s / r["horovod_step_s"])


def test_advise_says_what_is_missing():
    out = subprocess.run([sys.executable, "-m", "hvdsync.tools.advise", "--params", "1e8", "--ranks",
                          "8", "--bandwidth", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "--compute-ms" in out.stderr


BASE = ["--params", "25e6", "--layers", "54", "--compute-ms", "120", "--ranks", "8",
        "--bandwidth", "10"]


@pytest.mark.parametrize("bad,flag", [
    (["--bandwidth", "nan"], "--bandwidth"), (["--compute-ms", "-10"], "--compute-ms"),
    (["--layers", "0"], "--layers"), (["--params", "-5"], "--params"),
    (["--ranks", "-4"], "--ranks"), (["--ranks-per-node", "16"], "ranks_per_node"),
    (["--latency-us", "inf"], "--latency-us"), (["--layers", "1e9"], "--layers"),
    ("model:nosuch.module:f", "--model"), ("model:examples.torch.train_teacher:nosuch",
                                           "--model"),
    ("model:examples.torch.train_teacher:student --input-shape 64,x", "--input-shape"),
    ("model:tests.models:sparse_embedding --embedding-rows 0", "--embedding-rows"),
    ("model:tests.models:sparse_embedding --embedding-rows emb=5 --compute-ms 20",
     "--embedding-rows"),
])
def test_the_advisor_answers_bad_input_in_one_line(capsys, bad, flag):
    if isinstance(bad, str):  # a --model case: no --params
        model, *rest = bad.removeprefix("model:").split()
        argv = ["--model", model, *rest, "--ranks", "8", "--bandwidth", "10"]
    else:
        argv = BASE + bad
    with pytest.raises(SystemExit) as done:
        advise.main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "Traceback" not in err, err


def test_the_advisors_help_says_what_it_does_in_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        advise.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "prints the performance model's table" in out and "(docs/at-scale.md)" in out
