"""The core's contracts are closed (issue 30): everything the framework-neutral core calls on a
port or a technique is declared on the interface it goes through (hvdsync/core/technique.py), so
an adapter that implements the interfaces runs every technique, and no technique reaches into
an adapter's extras by name. A static check of the core's source: it fails the moment a core
module calls a member the interface does not declare."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

from hvdsync.core import technique
from hvdsync.techniques.delay.carried import Carryable, CarriedCompressor
from hvdsync.core.pending import Pending
from hvdsync.core.ports import Communicator, Gradients, RowSparse, TensorOps
from hvdsync.core.technique import Decider, Technique, Transform, Transport
from hvdsync.core.traced import TracedLocalStep

#: the framework-neutral modules: the core, safety and the techniques (core/technique.py,
#: core/ports.py and core/pending.py define the interfaces), and the tools
PACKAGE = pathlib.Path(technique.__file__).parent.parent
CORE = sorted(p for part in ("core", "safety", "techniques", "tools")
              for p in (PACKAGE / part).rglob("*.py")
              if p.relative_to(PACKAGE).as_posix() not in ("core/technique.py", "core/ports.py",
                                                           "core/pending.py"))

#: how the core names each port or technique -> the interfaces that declare what it may call
RECEIVERS = {
    "self.comm": (Communicator,), "comm": (Communicator,), "self.owner.comm": (Communicator,),
    "self.ops": (TensorOps,), "ops": (TensorOps,), "self.owner.ops": (TensorOps,),
    "self.grads": (Gradients,), "self.owner.grads": (Gradients,),
    "self.rows": (RowSparse,),  # sparse='s primitives
    "self.decider": (Decider,),
    "layer.pending": (Pending,), "pending": (Pending,), "p": (Pending,),
    # what delay= calls on the technique it carries (lowrank=)
    "self.compressor": (CarriedCompressor,), "compressor": (CarriedCompressor,),
    "carryable": (Carryable,),
}
#: in the pipeline only, where ``t`` is always a technique
PIPELINE_RECEIVERS = {"t": (Technique, Transform, Transport, TracedLocalStep)}


def declared(interface: type) -> set[str]:
    """What ``interface`` declares: its methods, properties and annotated attributes, with
    those of its bases."""
    names: set[str] = set()
    for cls in inspect.getmro(interface):
        if cls is object:
            continue
        names |= {n for n in vars(cls) if not n.startswith("__")}
        names |= set(getattr(cls, "__annotations__", {}))
    return names


def calls(path: pathlib.Path, receivers: dict) -> list[tuple[int, str, str]]:
    """``(line, receiver, member)`` for every member the module reads on a receiver."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            receiver = ast.unparse(node.value)
            if receiver in receivers:
                out.append((node.lineno, receiver, node.attr))
    return out


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_the_core_calls_only_what_the_interfaces_declare(path):
    receivers = dict(RECEIVERS)
    if path.name == "pipeline.py" and path.parent.name == "core":
        receivers.update(PIPELINE_RECEIVERS)
    if path.relative_to(PACKAGE).as_posix() in ("techniques/select/technique.py",
                                                "techniques/select/policy.py",
                                                "tools/perfmodel.py", "tools/advise.py"):
        # (their own local names)
        receivers = {k: v for k, v in receivers.items() if k not in ("p", "pending")}
    undeclared = [f"{path.name}:{line}: {receiver}.{member}"
                  for line, receiver, member in calls(path, receivers)
                  if not any(member in declared(i) for i in receivers[receiver])]
    assert not undeclared, "called but not declared on the interface: " + ", ".join(undeclared)


def test_the_check_sees_an_undeclared_call(tmp_path):
    """The check is not vacuous: a core module calling a port's extra is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f(self):\n    self.comm.reduce([], name='x')\n"
                   "    self.comm.allreduce('x', [])\n")
    found = [(r, m) for _, r, m in calls(bad, RECEIVERS)
             if not any(m in declared(i) for i in RECEIVERS[r])]
    assert found == [("self.comm", "reduce")]


def test_what_delay_carries_implements_the_declared_interface():
    """Every technique ``delay=`` may carry is :class:`Carryable`, and its carried form has
    each method of :class:`CarriedCompressor`, with the same parameters."""
    from hvdsync.techniques.delay.technique import DelayedGradients
    from hvdsync.techniques.lowrank.in_delay import DelayedLowRank
    from hvdsync.techniques.lowrank.in_step import LowRankCompression
    carried = {"lowrank": (LowRankCompression, DelayedLowRank)}
    assert set(DelayedGradients.carries) == set(carried)
    for before, inside in carried.values():
        for interface, cls in ((Carryable, before), (CarriedCompressor, inside)):
            for name in sorted(n for n in declared(interface) if not n.startswith("_")):
                ours = inspect.signature(getattr(interface, name))
                theirs = inspect.signature(getattr(cls, name))
                assert list(ours.parameters) == list(theirs.parameters), (cls.__name__, name)
