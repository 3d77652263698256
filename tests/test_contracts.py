"""The core's contracts are closed (issues 30 and 80): everything the framework-neutral core
and the techniques call on a port or a technique is declared on the interface it goes through,
so an adapter that implements the interfaces runs every technique, and no technique reaches
into an adapter's extras by name; what one technique alone needs of an adapter is declared in
its own package (``ports.py``), and a shared interface holds only what at least two
techniques implement or use (the members that do not yet are listed, each with the reason,
and the list only shrinks). Static checks of the source, and the adapters checked against
every port."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import pytest

from hvdsync.core import ports as core_ports
from hvdsync.core import technique
from hvdsync.core.wire import CodecOps, Pending
from hvdsync.core.ports import Communicator, Gradients, TensorOps
from hvdsync.core.technique import Decider, Parts, Technique, Transform, Transport
from hvdsync.core.traced import TracedRounds
from hvdsync.techniques.delay.carried import Carryable, CarriedCompressor

#: the framework-neutral modules: the core, safety and the techniques (core/technique.py,
#: core/ports.py and core/wire.py define the interfaces), and the tools
PACKAGE = pathlib.Path(technique.__file__).parent.parent
CORE = sorted(p for part in ("core", "safety", "techniques", "tools")
              for p in (PACKAGE / part).rglob("*.py")
              if p.relative_to(PACKAGE).as_posix() not in ("core/technique.py", "core/ports.py",
                                                           "core/wire.py"))
TECHNIQUES = sorted(p.name for p in (PACKAGE / "techniques").iterdir() if p.is_dir()
                    and (p / "__init__.py").exists())

#: how the core names each port or technique -> the interfaces that declare what it may call
RECEIVERS = {
    "self.comm": (Communicator,), "comm": (Communicator,), "self.owner.comm": (Communicator,),
    "self.ops": (TensorOps,), "ops": (TensorOps,), "self.owner.ops": (TensorOps,),
    "self.grads": (Gradients,), "self.owner.grads": (Gradients,),
    "self.decider": (Decider,),
    "layer.pending": (Pending,), "pending": (Pending,), "p": (Pending,),
    # what delay= calls on the technique it carries (lowrank=)
    "self.compressor": (CarriedCompressor,), "compressor": (CarriedCompressor,),
    "self.owner.compressor": (CarriedCompressor,),
    "carryable": (Carryable,),
}
#: in the pipeline only, where ``t`` is always a technique
PIPELINE_RECEIVERS = {"t": (Technique, Transform, Transport)}
#: a technique's own ports (its package's ``ports.EXTENDS``) extend these receivers
EXTENDED = {"ops": ("ops", "self.ops", "self.owner.ops"),
            "comm": ("comm", "self.comm", "self.owner.comm"),
            "grads": ("self.grads", "self.owner.grads"), "rows": ("self.rows", "rows")}


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


def technique_of(path: pathlib.Path) -> str:
    """The technique whose package holds ``path`` (``""``: none)."""
    parts = path.relative_to(PACKAGE).parts
    return parts[1] if parts[0] == "techniques" and len(parts) > 2 else ""


def own_ports(name: str) -> dict[str, type]:
    """A technique's own ports, by receiver kind (its package's ``ports.EXTENDS``)."""
    try:
        return importlib.import_module(f"hvdsync.techniques.{name}.ports").EXTENDS
    except ModuleNotFoundError:
        return {}


def receivers_of(path: pathlib.Path) -> dict:
    receivers = dict(RECEIVERS)
    rel = path.relative_to(PACKAGE).as_posix()
    if rel == "core/pipeline.py":
        receivers.update(PIPELINE_RECEIVERS)
    if rel == "core/wire.py":  # the codecs' own primitives
        receivers["ops"] = receivers["ops"] + (CodecOps,)
    if rel in ("techniques/select/technique.py", "techniques/select/policy.py",
               "tools/perfmodel.py", "tools/advise.py"):  # (their own local names)
        receivers = {k: v for k, v in receivers.items() if k not in ("p", "pending")}
    for kind, port in own_ports(technique_of(path)).items() if technique_of(path) else ():
        for receiver in EXTENDED[kind]:
            receivers[receiver] = receivers.get(receiver, ()) + (port,)
    return receivers


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_the_core_calls_only_what_the_interfaces_declare(path):
    receivers = receivers_of(path)
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
    from hvdsync.techniques.delay.technique import Delay
    from hvdsync.techniques.lowrank.in_delay import LowRankInDelay
    from hvdsync.techniques.lowrank.in_step import LowRank
    from hvdsync.core.rules import CARRIED
    carried = {"lowrank": (LowRank, LowRankInDelay)}
    assert {k for k, (by, _) in CARRIED.items() if by == Delay.name} == set(carried)
    for before, inside in carried.values():
        for interface, cls in ((Carryable, before), (CarriedCompressor, inside)):
            for name in sorted(n for n in declared(interface) if not n.startswith("_")):
                ours = inspect.signature(getattr(interface, name))
                theirs = inspect.signature(getattr(cls, name))
                assert list(ours.parameters) == list(theirs.parameters), (cls.__name__, name)


# -- a shared interface holds what techniques share --------------------------------------------
#: the moments' interfaces: a member serves the techniques that implement or call it (the core
#: asking every technique does not make it shared)
MOMENTS = (Technique, Transform, Decider, Transport, TracedRounds,
           CarriedCompressor, Carryable)
#: the ports, Pending and Parts: a member serves the techniques that use it, every one where
#: the core uses it
SHARED = (Gradients, core_ports.Arithmetic, core_ports.LayerStatistics, core_ports.Branching,
          Communicator, Pending, Parts)
#: what every technique is (its name, its role, its keyword): not a special case
IDENTITY = {"name", "role", "keyword"}
#: members that still serve one technique, each with why and where it goes (issue 80; the list
#: only shrinks)
ONE_TECHNIQUE = {
    "Technique.after_optimizer_step": "after the update only the synchronization of the "
                                      "models (outer) acts",
    "Transport.backward_done": "sparse='s counts round before missing layers are filled, and "
                               "the layers whose layout only the counts tell",
    "Transport.start_early": "the same: the counts and the predicted rows, before the rest",
}


def _module(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(
        ".__init__")


def _attributes(path: pathlib.Path) -> set[str]:
    return {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}


def serving() -> dict[str, set[str]]:
    """``"Interface.member"`` -> the techniques it serves (``"*"``: every one)."""
    implemented: dict[str, set[str]] = {}
    used: dict[str, set[str]] = {}
    owners = {p: technique_of(p) for p in (PACKAGE / "techniques").rglob("*.py")
              if technique_of(p)}
    owners[PACKAGE / "core/plain.py"] = "plain"
    owners[PACKAGE / "keras/sparse.py"] = "sparse"  # sparse='s traced form
    for path, name in owners.items():
        module = importlib.import_module(_module(path))
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == module.__name__:
                for member in set(vars(cls)) | set(vars(cls).get("__annotations__", {})):
                    implemented.setdefault(member, set()).add(name)
        for member in _attributes(path):
            used.setdefault(member, set()).add(name)
    core = set().union(*(_attributes(p) for part in ("core", "safety")
                         for p in (PACKAGE / part).rglob("*.py") if p.name != "plain.py"))
    out = {}
    for interfaces, by_use in ((MOMENTS, False), (SHARED, True)):
        for cls in interfaces:
            for member in {n for n in vars(cls) if not n.startswith("_")} | {
                    n for n in vars(cls).get("__annotations__", {}) if not n.startswith("_")}:
                who = implemented.get(member, set()) | used.get(member, set())
                if (by_use and member in core) or member in IDENTITY:
                    who = who | {"*"}
                out[f"{cls.__name__}.{member}"] = who
    return out


def test_no_shared_member_serves_one_technique_but_those_listed():
    """Every member of a shared interface is implemented or used by two techniques at least
    (the core's use of a port serves every one), or it is listed in ONE_TECHNIQUE with where
    it goes; a listed member that now serves two comes off the list."""
    single = {name for name, who in serving().items() if len(who) < 2 and "*" not in who}
    assert single - set(ONE_TECHNIQUE) == set(), "serve one technique: move them into it"
    assert set(ONE_TECHNIQUE) - single == set(), "serve two now: take them off ONE_TECHNIQUE"


def test_the_count_sees_a_member_that_serves_one():
    """Not vacuous: Transport's sparse-only ``backward_done`` serves sparse= alone, its
    ``start`` every transport."""
    who = serving()
    assert who["Transport.backward_done"] == {"sparse"}
    assert {"plain", "sparse", "lowrank", "delay"} <= who["Transport.start"]


@pytest.mark.parametrize("name", TECHNIQUES)
def test_a_techniques_own_ports_are_its_own(name):
    """What a technique's ``ports.py`` declares, the technique uses, and no other technique's
    module reaches for it through the shared receivers."""
    mine = {m for port in own_ports(name).values()
            for m in vars(port) if not m.startswith("_")}
    if not mine:
        return
    uses = set().union(*(_attributes(p) for p in (PACKAGE / "techniques" / name).rglob("*.py")))
    assert mine <= uses, f"declared, never used: {sorted(mine - uses)}"


def _adapter_classes() -> dict[str, tuple]:
    from hvdsync.keras.backend import KerasGradients
    from hvdsync.keras.comm import KerasCommunicator
    from hvdsync.keras.ops import KerasOps
    from hvdsync.torch.backend import TorchGradients
    from hvdsync.torch.comm import TorchCommunicator
    from hvdsync.torch.ops import TorchOps
    return {"ops": (TorchOps, KerasOps), "grads": (TorchGradients, KerasGradients),
            "comm": (TorchCommunicator, KerasCommunicator)}


def test_both_adapters_implement_every_port():
    """Both adapters implement every shared port, the codecs' and every technique's own: an
    adapter that does runs every technique and every encoding."""
    shared = {"ops": TensorOps, "grads": Gradients, "comm": Communicator}
    for kind, classes in _adapter_classes().items():
        codecs = declared(CodecOps) if kind == "ops" else set()
        wanted = declared(shared[kind]) | codecs | {m for name in TECHNIQUES
                                                    for k, port in own_ports(name).items()
                                                    if k == kind for m in declared(port)}
        wanted -= {"size", "matches_by_name", "entries", "averages"}  # (set by __init__)
        for cls in classes:
            missing = sorted(m for m in wanted if not m.startswith("_") and not hasattr(cls, m))
            assert not missing, f"{cls.__name__} lacks {missing}"
