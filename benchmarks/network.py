"""Run Horovod ranks on an emulated slow network: each rank in its own network namespace,
joined by a bridge, its link limited by ``tc`` (rate, and delay where the kernel has netem).

    with EmulatedNetwork(np=4, rate_mbit=100, delay_ms=1) as net:
        results = run_ranks_on(net, body, np=4, args=(...,))

Needs root and iproute2 (``ip netns``, ``tc``); :func:`namespaces_unavailable` says why not
where it cannot run, and ``run_ranks_on(None, ...)`` runs on loopback instead (horovodrun).
Everything the harness creates (namespaces ``hvs<pid>r<i>``, bridge ``hvs<pid>br``, addresses
in 10.213.<k>.0/24 only inside those, ``/etc/netns/<namespace>/hosts``) is removed on exit,
also after errors.

How a link is limited: a token bucket (``tbf``) on both ends of each rank's veth pair, so a
rank's sends and its receives are each capped at ``rate_mbit`` like a NIC's; ``delay_ms``
adds a netem delay on the rank's egress. Some kernels (this project's CI machines among them)
have no netem: then the delay is reported as not emulated and only the rate applies.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, Optional

from hvdsync.testing import progress
from hvdsync.testing import (collect_results, rank_command, rank_env, run_ranks,
                             write_call)

IFACE = "hvs0"  # the rank's interface name inside its namespace (the same in every one)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _tc(ns: Optional[str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    return subprocess.run([*prefix, "tc", *args], capture_output=True, text=True, check=check)


def namespaces_unavailable() -> Optional[str]:
    """Why the emulated network cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the benchmark as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found: install iproute2"
    probe = f"hvs{os.getpid()}probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _netem_available(ns: str, dev: str) -> bool:
    ok = _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "9:", "netem", "delay", "1ms",
             check=False).returncode == 0
    if ok:
        _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
    return ok


class EmulatedNetwork:
    """``np`` ranks, each in its own namespace on one bridge, each link limited to
    ``rate_mbit`` (and ``delay_ms`` one-way on its egress, where netem exists): a rank's NIC.
    With ``ranks_per_node``, nodes of that many ranks: a node's ranks on a bridge of its own,
    unlimited (the fast links inside a node), the node's uplink to the others limited (the
    node's NIC)."""

    def __init__(self, np: int, rate_mbit: float, delay_ms: float = 0.0,
                 ranks_per_node: int = 1):
        if np < 1 or ranks_per_node < 1 or np % ranks_per_node:
            raise ValueError(f"np must be >= 1 and a multiple of ranks_per_node, got {np}, "
                             f"{ranks_per_node}")
        if rate_mbit <= 0 or delay_ms < 0:
            raise ValueError(f"need rate_mbit > 0 and delay_ms >= 0, got {rate_mbit}, {delay_ms}")
        self.np, self.rate_mbit, self.delay_ms = np, rate_mbit, delay_ms
        self.ranks_per_node = ranks_per_node
        tag = f"hvs{os.getpid() % 100000}"
        self.bridge = f"{tag}br"
        self.namespaces = [f"{tag}r{i}" for i in range(np)]
        self._host_ends = [f"{tag}v{i}" for i in range(np)]
        nodes = np // ranks_per_node if ranks_per_node > 1 else 0
        self._node_bridges = [f"{tag}n{n}" for n in range(nodes)]
        self._uplinks = [(f"{tag}u{n}", f"{tag}w{n}") for n in range(nodes)]  # node, core end
        subnet = 10 + os.getpid() % 200
        self.addresses = [f"10.213.{subnet}.{i + 1}" for i in range(np)]
        self.server_ip = f"10.213.{subnet}.254"
        self.delay_emulated = False

    @property
    def hosts(self) -> list[str]:
        """One name per node (its first rank's address), for Horovod's slots: a node's ranks
        are one host's local ranks."""
        return self.addresses[::self.ranks_per_node]

    # -- set up / tear down ---------------------------------------------------------------
    def __enter__(self) -> "EmulatedNetwork":
        # A plain SIGTERM (e.g. `kill`) would skip __exit__ and leave the namespaces behind.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.server_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for node_bridge, (node_end, core_end) in zip(self._node_bridges, self._uplinks):
            _ip("link", "add", node_bridge, "type", "bridge")
            _ip("link", "set", node_bridge, "up")
            _ip("link", "add", node_end, "type", "veth", "peer", "name", core_end)
            for end, bridge in ((node_end, node_bridge), (core_end, self.bridge)):
                _ip("link", "set", end, "master", bridge)
                _ip("link", "set", end, "up")
            self._limit(None, node_end, core_end)  # the node's NIC, both ways
        for i, (ns, host_end, addr) in enumerate(zip(self.namespaces, self._host_ends,
                                                     self.addresses)):
            _ip("netns", "add", ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", IFACE, "netns", ns)
            node = i // self.ranks_per_node
            _ip("link", "set", host_end, "master",
                self._node_bridges[node] if self._node_bridges else self.bridge)
            _ip("link", "set", host_end, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE)
            _ip("-n", ns, "link", "set", IFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # Horovod 0.28.1 binds its process-set Gloo contexts to the address of this
            # machine's hostname whatever HOROVOD_GLOO_IFACE says; `ip netns exec` reads
            # /etc/netns/<ns>/hosts as /etc/hosts, where the hostname is the rank's address.
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
            if not self._node_bridges:
                self._limit(ns, IFACE, host_end)

    def _limit(self, ns: Optional[str], dev: str, other_end: str) -> None:
        """Limit a link at both ends (``dev`` in namespace ``ns``, ``other_end`` here)."""
        rate = f"{self.rate_mbit:g}mbit"
        # burst: at least one 64 KiB TSO segment and ~2 ms at the rate, so tbf can keep up
        burst = str(max(65536 * 2, int(self.rate_mbit * 1e6 / 8 * 0.002)))
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", "100ms"]
        if self.delay_ms > 0 and _netem_available(ns, dev):
            _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                f"{self.delay_ms:g}ms")
            _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
            self.delay_emulated = True
        else:
            _tc(ns, "qdisc", "add", "dev", dev, "root", *tbf)
        _tc(None, "qdisc", "add", "dev", other_end, "root", *tbf)

    def close(self) -> None:
        """Remove every namespace (their veths go with them) and the bridge."""
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        for host_end in self._host_ends:
            _ip("link", "del", host_end, check=False)
        for node_end, _ in self._uplinks:  # (its peer goes with it)
            _ip("link", "del", node_end, check=False)
        for bridge in [*self._node_bridges, self.bridge]:
            _ip("link", "del", bridge, check=False)

    def describe(self) -> str:
        delay = (f", {self.delay_ms:g} ms delay" if self.delay_emulated else
                 ", delay not emulated (no netem in this kernel)" if self.delay_ms else "")
        if self.ranks_per_node > 1:
            return (f"{len(self._node_bridges)} nodes x {self.ranks_per_node} ranks (a bridge "
                    f"inside a node, unlimited), {self.rate_mbit:g} Mbit/s per node link{delay}")
        return f"{self.rate_mbit:g} Mbit/s per rank link{delay}"


def run_ranks_on(network: Optional[EmulatedNetwork], fn: Callable[..., Any], np: int,
                 args: tuple = (), kwargs: dict | None = None, timeout: float = 600) -> list[Any]:
    """:func:`hvdsync.testing.run_ranks`, with rank ``i`` in ``network``'s namespace ``i``
    (Horovod's Gloo rendezvous server runs here, on the bridge). ``None``: loopback."""
    if network is None:
        return run_ranks(fn, np=np, args=args, kwargs=kwargs, timeout=timeout)
    if np != network.np:
        raise ValueError(f"the network has {network.np} namespaces, asked for {np} ranks")
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousServer

    hosts = ",".join(f"{a}:{network.ranks_per_node}" for a in network.hosts)
    plan = get_host_assignments(parse_hosts(hosts), np)
    server = RendezvousServer()
    port = server.start()
    server.init(plan)
    procs, logs = [], []
    with tempfile.TemporaryDirectory(prefix="hvdsync-net-") as tmp:
        name = write_call(tmp, fn, args, kwargs)
        progress.job(f"{fn.__name__} on {np} ranks")
        base = rank_env({**progress.job_env(tmp), **{k: str(v) for k, v in create_run_env_vars(
            network.server_ip, [IFACE], port).items()}})
        start = time.monotonic()
        try:
            for slot, ns in zip(plan, network.namespaces):  # (host by host: rank order)
                env = {**base, **create_slot_env_vars(slot)}
                log = open(os.path.join(tmp, f"rank{slot.rank}.log"), "w+")
                logs.append(log)
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *rank_command(tmp)],
                                              stdout=log, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
            hung, deadline = False, start + timeout
            for p in procs:
                while not hung:
                    try:  # (in short waits, showing the ranks' progress meanwhile)
                        p.wait(timeout=min(max(deadline - time.monotonic(), 0.1), 1.0))
                        break
                    except subprocess.TimeoutExpired:
                        hung = time.monotonic() >= deadline
                        progress.poll(tmp)
                if hung:
                    break
            progress.poll(tmp)  # (the ranks' last report)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
            server.stop()
        output = []
        for r, log in enumerate(logs):
            log.seek(0)
            output += [f"[{r}]<stdout>:{line.rstrip()}" for line in log]
            log.close()
        code = next((p.returncode for p in procs if p.returncode), 0)
        return collect_results(tmp, np, name, hung, code, timeout, time.monotonic() - start,
                               "\n".join(output))


def _selftest() -> None:  # python -m benchmarks.network: a quick bandwidth check
    reason = namespaces_unavailable()
    if reason:
        sys.exit(f"emulated network unavailable: {reason}")
    with EmulatedNetwork(2, rate_mbit=100, delay_ms=1) as net:
        out = run_ranks_on(net, _allreduce_seconds, np=2, args=(4 << 20,), timeout=120)
        mbit = 2 * (4 << 20) * 8 / 2 / out[0] / 1e6  # ring: 2(N-1)/N * size per rank
        print(f"{net.describe()}: 4 MiB allreduce {out[0] * 1e3:.0f} ms, ~{mbit:.0f} Mbit/s")


def _allreduce_seconds(nbytes: int) -> float:
    import horovod.torch as hvd
    import torch
    hvd.init()
    t = torch.ones(nbytes // 4)
    hvd.allreduce(t, name="warm")
    start = time.perf_counter()
    for i in range(3):
        hvd.allreduce(t, name=f"x{i}")
    return (time.perf_counter() - start) / 3


if __name__ == "__main__":
    _selftest()
