"""The rulebook (hvdsync/core/rules.py) is one: every pair of techniques is accepted or refused
alike by the torch and the Keras factories, refusals name the rule and its reason, and the
table in docs/design.md lists every refused pair."""

from __future__ import annotations

import itertools
import os

import pytest

from hvdsync.core import rules

#: one small valid config per technique (global clip is a setting of its own)
CONFIGS = {"clip": 1.0, "clip_global": dict(max_norm=1.0, mode="global"), "threshold": 0.5,
           "select": 1, "sparse": True, "delay": 2}


def _kwargs(names: tuple[str, ...]) -> dict:
    return {("clip" if n == "clip_global" else n): CONFIGS[n] for n in names}


def _outcome(make, names) -> str:
    try:
        make(**_kwargs(names))
    except ValueError as e:
        return f"refused: {e}"
    return "accepted"


def _combinations():
    keys = list(CONFIGS)
    for r in (2, 3):
        for names in itertools.combinations(keys, r):
            if not ("clip" in names and "clip_global" in names):
                yield names


def test_torch_and_keras_accept_the_same_combinations():
    import keras
    import torch

    import hvdsync.keras as khvd
    import hvdsync.torch as thvd
    from tests.models import MLP
    thvd.init()
    khvd.init()
    m = MLP()

    def torch_opt(**kw):
        thvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                  named_parameters=m.named_parameters(), **kw)

    def keras_opt(**kw):
        khvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **kw)

    accepted = 0
    for names in _combinations():
        t, k = _outcome(torch_opt, names), _outcome(keras_opt, names)
        assert t == k, f"{names}: torch {t!r}, Keras {k!r}"
        accepted += t == "accepted"
        if t != "accepted":  # the message says which rule and why
            assert "cannot be combined with" in t and ":" in t, t
    assert accepted >= 10  # e.g. sparse + threshold, sparse + select, delay + clip


@pytest.mark.parametrize("combo", [("sparse", "threshold"), ("sparse", "select"),
                                   ("delay", "clip"), ("clip_global", "threshold"),
                                   ("clip", "threshold", "sparse")])
def test_the_compositions_the_design_promises_are_accepted(combo):
    configs = rules.configure(op="average", sparse_as_dense=False, **_kwargs(combo))
    assert set(configs) == {("clip" if n == "clip_global" else n) for n in combo}
    assert rules.pipeline_order(configs)[-1] == ("delay" if "delay" in combo else "plain")


def test_every_exclusion_is_in_the_design_table():
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "design.md")
    table = open(path).read().split("## The rulebook", 1)[1]
    for rule in rules.EXCLUSIONS:
        first = f"{rule.first}=" if rule.first in rules.TECHNIQUES else rule.first
        assert f"`{first}`" in table, rule.first
        second = rule.second.replace("clip mode 'global'", "clip mode `'global'`")
        second = f"`{second}=`" if rule.second in rules.TECHNIQUES else second
        assert second in table, rule.second


def test_ops_each_technique_needs():
    with pytest.raises(ValueError, match="needs op=Average"):
        rules.configure(op="sum", sparse_as_dense=False, delay=2)
    for name in ("sparse", "threshold", "select"):
        rules.configure(op="sum", sparse_as_dense=False, **{name: CONFIGS[name]})
        with pytest.raises(ValueError, match="op=Average or op=Sum"):
            rules.configure(op="other", sparse_as_dense=False, **{name: CONFIGS[name]})


@pytest.mark.parametrize("arg,typo,meant", [
    ("clip", "max_nrm", "max_norm"), ("threshold", "treshold", "threshold"),
    ("select", "kk", "k"), ("sparse", "dense_ration", "dense_ratio"),
    ("lowrank", "rnk", "rank"), ("delay", "stalenes", "staleness")])
def test_a_typo_inside_a_config_dict_names_the_key_meant_and_the_fields(arg, typo, meant):
    import dataclasses

    from hvdsync.techniques.clip.config import ClipConfig
    from hvdsync.core.config import coerce_config
    from hvdsync.techniques.delay.config import DelayConfig
    from hvdsync.techniques.lowrank.config import LowRankConfig
    from hvdsync.techniques.select.config import SelectConfig
    from hvdsync.techniques.sparse.config import SparseConfig
    from hvdsync.techniques.threshold.config import ThresholdConfig
    cls = {"clip": ClipConfig, "threshold": ThresholdConfig, "select": SelectConfig,
           "sparse": SparseConfig, "lowrank": LowRankConfig, "delay": DelayConfig}[arg]
    with pytest.raises(TypeError) as info:
        coerce_config(cls, {typo: 1}, arg, meant)
    said = str(info.value)
    assert f"{arg}= got unknown key(s) '{typo}' (did you mean '{meant}'?)" in said, said
    assert all(f.name in said for f in dataclasses.fields(cls) if f.init), said


def test_every_refused_pair_states_its_own_reason():
    reasons = [rule.why for rule in rules.EXCLUSIONS]
    assert len(set(reasons)) == len(reasons)
    assert not any("same reason" in why for why in reasons)
