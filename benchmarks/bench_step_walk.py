"""How far one step walks through hvdsync's files (issue 80): one step of a 12-layer MLP
(``Linear(64, 64)`` + ReLU, SGD) on one rank, its sixth, profiled with ``sys.setprofile``.
Counted: the hvdsync files the step enters, and the calls from one hvdsync file into another
(the caller's frame in another hvdsync file), in all and per layer -- the hops a reader follows
to see what a step does, and, on a GPU, Python work that does not shrink with a faster
device.

    python -m benchmarks.bench_step_walk                     # this tree, as "after"
    PYTHONPATH=<another checkout>:. python -m benchmarks.bench_step_walk --label before

Each run adds its rows (by ``--label``) to ``benchmarks/results/step_walk.{md,json}``; the
engine is Horovod where it is installed (``--backend``), as a one-rank job.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from typing import Any

from benchmarks.common import RESULTS, markdown_table, write_results, shows_progress
from hvdsync.testing import progress

#: configuration -> hvdsync keywords
CASES: dict[str, dict[str, Any]] = {
    "nothing on": {},
    "clip=1.0": dict(clip=1.0),
    'delay="streaming"': dict(delay="streaming"),
    'clip=1.0, delay="streaming"': dict(clip=1.0, delay="streaming"),
}
DEPTH, WIDTH, PROFILED_STEP = 12, 64, 6


def walk(options: dict[str, Any]) -> dict[str, Any]:
    """One configuration: the files its profiled step enters, and the cross-file calls."""
    import torch
    from torch import nn

    import hvdsync
    import hvdsync.torch as hvd
    root = os.path.dirname(hvdsync.__file__) + os.sep
    torch.manual_seed(0)
    layers: list = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = nn.Sequential(*layers)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), **options)
    x, y = torch.randn(32, WIDTH), torch.randn(32, WIDTH)
    files: collections.Counter = collections.Counter()
    cross: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(root):
            return
        path = frame.f_code.co_filename
        files[path[len(root):]] += 1
        back = frame.f_back
        if back is not None and back.f_code.co_filename.startswith(root) \
                and back.f_code.co_filename != path:
            cross[f"{back.f_code.co_filename[len(root):]} -> {path[len(root):]}"] += 1
    for step in range(1, PROFILED_STEP + 1):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if step == PROFILED_STEP:
            sys.setprofile(profile)
        loss.backward()
        opt.step()
        sys.setprofile(None)
    calls = sum(cross.values())
    return {"files": len(files), "calls": calls, "per_layer": calls / DEPTH,
            "entered": dict(files.most_common()), "hops": dict(cross.most_common())}


@shows_progress
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="after", help="the rows' name (e.g. before, after)")
    ap.add_argument("--backend", default=None, help="horovod or torch (default: hvd's rule)")
    ap.add_argument("--name", default="step_walk")
    args = ap.parse_args(argv)
    if args.backend:
        os.environ["HVDSYNC_BACKEND"] = args.backend
    import hvdsync.torch as hvd
    hvd.init()
    path = RESULTS / f"{args.name}.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.pop("meta", None)
    data[args.label] = {"backend": hvd.backend_name(),
                        "cases": {}}
    for i, (name, options) in enumerate(CASES.items()):
        progress.step(i, len(CASES), name)
        data[args.label]["cases"][name] = walk(options)
    rows = [[label, run["backend"], name, case["files"], case["calls"],
             f"{case['per_layer']:.1f}"]
            for label, run in data.items() for name, case in run["cases"].items()]
    table = markdown_table(["tree", "engine", "configuration", "hvdsync files entered",
                            "cross-file calls", "per layer"], rows)
    print(table)
    write_results(args.name, data, table, "python -m benchmarks.bench_step_walk "
                  + " ".join(argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    main()
