"""The benchmark suite's bookkeeping (no ranks): time to a per-seed target and its spread."""

import pytest

from benchmarks import bench_suite
from benchmarks.bench_suite import rows_for, summarize


def _run(curve, final, steps=300, step_s=0.1, early=None):
    return dict(curve=curve, final=final, early=early, steps=steps, step_s=step_s,
                bytes_per_step=100.0, collectives_per_step=1.0)


def test_time_to_target_is_per_seed_and_reported_with_its_spread():
    # seed 0: Horovod ends at 0.80 (target 0.795); seed 1 at 0.60 (target 0.595). The other
    # method reaches seed 0's target at 5 s (Horovod: 10 s) and seed 1's at 3 s (Horovod 6 s)
    horovod = [_run([(5, 0.5), (10, 0.80)], 0.80), _run([(3, 0.4), (6, 0.60)], 0.60)]
    other = [_run([(5, 0.795), (10, 0.81)], 0.81), _run([(3, 0.60), (6, 0.62)], 0.62)]
    rank = {"horovod": horovod, "other": other}
    s = summarize([rank, rank], ["horovod", "other"], "digits_mlp")
    assert s["targets"] == pytest.approx([0.795, 0.595])
    m = s["methods"]["other"]
    assert m["time_to_target_ratio"] == pytest.approx(0.5)
    assert m["time_to_target_ratio_sd"] == pytest.approx(0.0)
    assert m["time_to_target"] == pytest.approx(4.0)
    # with one common target (the mean, 0.695) seed 0 would have counted Horovod at 10 s
    # and the other method at 5 s, seed 1 never: per-seed targets are what is asked


def test_a_seed_that_misses_its_target_leaves_the_ratio_out_and_says_so():
    horovod = [_run([(10, 0.80)], 0.80), _run([(6, 0.60)], 0.60)]
    other = [_run([(10, 0.70)], 0.70), _run([(3, 0.61)], 0.61)]
    rank = {"horovod": horovod, "other": other}
    s = summarize([rank], ["horovod", "other"], "digits_mlp")
    assert s["methods"]["other"]["time_to_target_ratio"] is None
    assert s["methods"]["other"]["time_to_target_ratios"] == [None, pytest.approx(0.5)]
    row = rows_for("cell", s, "digits_mlp")[1]
    assert row[2] == "not reached (1/2)" and row[3] == "-"


def test_loss_metric_is_shown_as_a_loss():
    # scores are minus the loss: Horovod ends at loss 2.0; the other at 1.9 (better)
    horovod = [_run([(10, -2.0)], -2.0)]
    other = [_run([(4, -1.99), (8, -1.9)], -1.9)]
    rank = {"horovod": horovod, "other": other}
    s = summarize([rank], ["horovod", "other"], "stdlib_lm")
    assert s["targets"] == pytest.approx([-2.01])
    assert s["methods"]["other"]["time_to_target_ratio"] == pytest.approx(0.4)
    row = rows_for("cell", s, "stdlib_lm")[1]
    assert row[4] == "1.900 +- 0.000" and row[5] == "1.900 (300)"


def test_a_longer_cell_has_a_second_target_at_the_workloads_own_steps():
    # 900 steps; Horovod's loss is 2.5 at step 300 (12 s) and 2.0 at its end (36 s). The other
    # method gets to 2.51 at 3 s and to 2.01 at 18 s: 0.25 and 0.5 of Horovod's times
    horovod = [_run([(12, -2.5), (24, -2.2), (36, -2.0)], -2.0, steps=900, early=-2.5)]
    other = [_run([(3, -2.5), (9, -2.2), (18, -2.0)], -2.0, steps=900, early=-2.3)]
    rank = {"horovod": horovod, "other": other}
    s = summarize([rank], ["horovod", "other"], "stdlib_lm")
    assert s["early_targets"] == pytest.approx([-2.51])
    m = s["methods"]["other"]
    assert m["early"]["time_to_target_ratio"] == pytest.approx(0.25)
    assert m["time_to_target_ratio"] == pytest.approx(0.5)
    row = rows_for("cell", s, "stdlib_lm")[1]
    assert row[2] == "3.0 / 18.0" and row[3] == "0.25 +- 0.00 / 0.50 +- 0.00"


def test_seeds_in_jobs_of_their_own_join_in_seed_order(monkeypatch):
    """--job-per-seed: each seed's ranks start afresh; every rank's runs of each method are
    joined over the jobs, seed by seed."""
    calls = []

    def fake_run(net, fn, np_, args, timeout):
        seeds = args[2]
        calls.append(seeds)
        return [{"horovod": [f"h{r}s{s}" for s in seeds], "m": [f"m{r}s{s}" for s in seeds]}
                for r in range(np_)]
    monkeypatch.setattr(bench_suite, "run_ranks_on", fake_run)
    per_rank = bench_suite._seeds_run(None, 2, [[0], [1], [2]], lambda seeds: ("w", [], seeds))
    assert calls == [[0], [1], [2]]
    assert per_rank[1] == {"horovod": ["h1s0", "h1s1", "h1s2"], "m": ["m1s0", "m1s1", "m1s2"]}
    assert bench_suite._seeds_run(None, 2, [[0, 1]], lambda seeds: ("w", [], seeds))[0] == {
        "horovod": ["h0s0", "h0s1"], "m": ["m0s0", "m0s1"]}
