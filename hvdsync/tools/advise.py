"""Which technique for my model, ranks and network? ``python -m hvdsync.tools.advise`` prints the
performance model's table (:mod:`hvdsync.tools.perfmodel`) and a recommendation with its reason
(docs/at-scale.md)::

    python -m hvdsync.tools.advise --preset gpt-125m --ranks 64 --ranks-per-node 8 --bandwidth 100
    python -m hvdsync.tools.advise --params 25e6 --layers 54 --compute-ms 120 --ranks 8 --bandwidth 10
    python -m hvdsync.tools.advise --model examples.torch.train_teacher:student --input-shape 64,32 \\
        --measure --ranks 16 --bandwidth 1

Offline, in seconds. Time per step and bytes are modelled; the steps a technique needs to reach
the baseline's quality are *measured* on the bench bed for a family of models
(:data:`hvdsync.tools.steps.MEASURED_STEPS`, with the source); time to target is their product."""

from __future__ import annotations

import argparse
import importlib
import math
import re
import sys
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

from hvdsync.tools import perfmodel, twolevel
from hvdsync.tools.steps import MEASURED_STEPS, steps_factor
from hvdsync.tools.perfmodel import Cluster, Constants, LayerSize, ModelSizes, Prediction

#: what a data-centre GPU cluster is assumed to do (NCCL, one GPU per rank): not fitted --
#: no GPU cluster here (docs/at-scale.md says what each assumption rests on)
GPU_CLUSTER = Constants(link_efficiency=0.8, collective_s=3.0e-5, fusion_bytes=64 * 2 ** 20,
                        overlap=0.7, layer_s=2.0e-5, decider_s=2.0e-4, delay_s=1.0e-4,
                        ddp_s=1.0e-4, cast_s=2.0e-12, norm_s=1.0e-12, accumulate_s=2.0e-12,
                        flops=1.0e13, matrix_s=3.0e-5, step_s=2.0e-4)

#: what the advisor chooses from: Horovod, its fp16, and hvdsync's communication techniques
#: (``clip=`` is for training stability, not speed; the peers are shown for comparison)
CANDIDATES = ("horovod", "horovod fp16", "hvdsync threshold", "hvdsync select",
              "hvdsync sparse", "hvdsync lowrank", "hvdsync delay", "hvdsync streaming")
#: how to turn each choice on: the keyword the bench bed ran it with (benchmarks/suite_methods.py)
KEYWORDS = {
    "horovod": "", "horovod fp16": "compression=hvd.Compression.fp16",
    "hvdsync threshold": "threshold=dict(threshold=0.05, relative=True, max_skip=8)",
    "hvdsync select": "select=dict(k=0.5)", "hvdsync sparse": "sparse=True",
    "hvdsync lowrank": "lowrank=dict(rank=2, warmup_steps=10)",
    "hvdsync delay": "delay=dict(staleness=4, average_every=32)",
    "hvdsync streaming": 'delay="streaming"',
}


def line_to_paste(technique: str) -> str:
    """The wrapper line that turns ``technique`` on (torch; Keras takes the same keywords; a
    two-level row's after ``hvd.init`` with the node sets: docs/nodes.md)."""
    flat = technique.removesuffix(twolevel.SUFFIX)
    keyword = ", ".join(k for k in (KEYWORDS[flat], 'between="nodes"' * (flat != technique)) if k)
    return ("hvd.init(process_sets=hvd.node_process_sets())\n    " * (flat != technique)
            + "opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters()"
            + (f", {keyword})" if keyword else ")"))


def _name(row: dict) -> str:
    """A row's technique as :data:`CANDIDATES` names it (a two-level row's flat name)."""
    return row["prediction"].technique.removesuffix(twolevel.SUFFIX)


#: a technique is recommended over Horovod (or its fp16) only if it predicts at least this
#: much less time to target: below it, model error and seeds' spread decide
MARGIN = 0.9


# -- models by name ---------------------------------------------------------------------------
def transformer(params_layers: int, d: int, vocab: int, context: int) -> tuple[LayerSize, ...]:
    """A GPT-style decoder's layers: embeddings, per block attention and MLP (with their
    norms and biases), the final norm; the head tied to the token embedding."""
    layers = [LayerSize("tok", vocab * d, ((vocab, d),)), LayerSize("pos", context * d,
                                                                      ((context, d),))]
    for i in range(params_layers):
        layers += [LayerSize(f"block{i}.attn", 4 * d * d + 4 * d, ((3 * d, d), (d, d)), tensors=4),
                   LayerSize(f"block{i}.mlp", 8 * d * d + 5 * d, ((4 * d, d), (d, 4 * d)),
                             tensors=4),
                   LayerSize(f"block{i}.norms", 4 * d, tensors=4)]
    return tuple(layers + [LayerSize("norm", 2 * d, tensors=2)])


def resnet50() -> tuple[LayerSize, ...]:
    """ResNet-50's layers (convolutions with their batch norms; the classifier)."""
    layers = [LayerSize("conv1", 64 * 3 * 49 + 128, ((64, 3 * 49),), tensors=3)]
    cin = 64
    for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        for b in range(blocks):
            shapes = [(width, cin), (width, width * 9), (4 * width, width)]
            if b == 0:
                shapes.append((4 * width, cin))
            params = sum(m * k for m, k in shapes) + 2 * (2 * width + 4 * width)
            layers.append(LayerSize(f"stage{stage}.{b}", params, tuple(shapes),
                                    tensors=3 * len(shapes)))
            cin = 4 * width
    return tuple(layers + [LayerSize("fc", 2048 * 1000 + 1000, ((1000, 2048),), tensors=2)])


@dataclass(frozen=True)
class Preset:
    layers: tuple[LayerSize, ...]
    flops_per_step: float  # forward + backward, one rank
    family: str
    what: str


def presets(tokens: int, images: int) -> dict[str, Preset]:
    """Named models; compute from flops (``tokens``/``images`` per rank per step)."""
    def gpt(d: int, blocks: int, what: str) -> Preset:
        layers = transformer(blocks, d, 50257, 2048)
        params = sum(layer.params for layer in layers)
        return Preset(layers, 6 * params * tokens, "transformer", what)
    return {"gpt-125m": gpt(768, 12, "GPT, 125M parameters (d 768, 12 blocks)"),
            "gpt-1.3b": gpt(2048, 24, "GPT, 1.3B parameters (d 2048, 24 blocks)"),
            "resnet50": Preset(resnet50(), 3 * 4.1e9 * images, "cnn",
                               "ResNet-50, 25.6M parameters")}


def _load(spec: str) -> Any:
    module, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"--model takes module:callable, got {spec!r}")
    try:
        return getattr(importlib.import_module(module), name)()
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--model {spec!r}: {e}") from e


def _embeddings(model: Any) -> list[tuple[str, int, bool]]:
    """``(layer name as perfmodel names it, table rows, whether its gradient is row-sparse)``
    of each embedding of a torch module or Keras model."""
    if hasattr(model, "named_modules"):  # torch: row-sparse only with sparse=True
        import torch
        kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
        return [(name, m.num_embeddings, bool(m.sparse)) for name, m in model.named_modules()
                if isinstance(m, kinds)]
    import keras  # Keras: an Embedding's gradient is IndexedSlices
    return [(layer.embeddings.path.rsplit("/", 1)[0], int(layer.input_dim), True)
            for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.Embedding)]


def embedding_rows(model: Any, given: Optional[str], input_shape: Optional[tuple[int, ...]]
                   ) -> tuple[dict[str, int], list[str]]:
    """Rows one rank's batch touches per step in each row-sparse embedding (what ``sparse=``
    sends): ``given`` (``ROWS`` for every embedding, or ``NAME=ROWS,...``), else at most one
    row per lookup of a batch of ``input_shape``; and notes for the reader."""
    found = _embeddings(model)
    notes = [f"{name}: an embedding with sparse=False has dense gradients; build it with "
             "sparse=True for sparse= to apply" for name, _, sparse in found if not sparse]
    tables = {name: rows for name, rows, sparse in found if sparse}
    if not tables:
        return {}, notes
    if given:
        if "=" not in given:
            return {name: min(int(given), rows) for name, rows in tables.items()}, notes
        out = {}
        for part in given.split(","):
            name, _, rows = part.partition("=")
            if name.strip() not in tables:
                raise ValueError(f"--embedding-rows names {name.strip()!r}; the model's "
                                 f"row-sparse embeddings are {sorted(tables)}")
            out[name.strip()] = int(rows)
        return out, notes
    if input_shape is None:
        return {}, notes + ["the model has row-sparse embeddings: give --embedding-rows (rows "
                            "a rank's batch touches per step) or --input-shape to weigh sparse="]
    lookups = math.prod(input_shape)
    notes.append(f"embedding rows estimated as at most one per lookup ({lookups} a batch): "
                 "repeated tokens touch fewer; --embedding-rows sets them")
    return {name: min(lookups, rows) for name, rows in tables.items()}, notes


def _measuring(steps: Iterable) -> Iterable:
    """The measured steps, their progress on stderr (an updating line on a terminal)."""
    from rich import console, progress
    return progress.track(steps, "--measure: timing one local step", transient=True,
                          console=console.Console(file=sys.stderr))


def sizes_from_module(model: Any, input_shape: Optional[tuple[int, ...]], measure: bool,
                      compute_s: Optional[float], rows: Optional[dict[str, int]] = None
                      ) -> ModelSizes:
    """A torch module's (or Keras model's) sizes; its compute per step timed on random
    inputs of ``input_shape`` (``measure``) or given; ``rows``: per embedding, the rows a
    rank's batch touches (:func:`embedding_rows`)."""
    layers = perfmodel.layers_of(model, rows)
    adapter = "torch" if hasattr(model, "named_parameters") else "keras"
    if measure:
        if input_shape is None:
            raise SystemExit("--measure needs --input-shape (a batch's shape, e.g. 64,32)")
        if hasattr(model, "named_parameters"):
            import torch
            x = torch.randn(*input_shape)
            out = model(x)
            y = torch.randint(out.shape[-1], out.shape[:1])
            f, b, o = perfmodel.measure_torch(model, (x, y), torch.nn.functional.cross_entropy,
                                              torch.optim.SGD(model.parameters(), lr=1e-3),
                                              shown=_measuring)
            return ModelSizes(layers, f, b, o, adapter=adapter)
        import numpy as np  # a Keras model
        x = np.random.default_rng(0).standard_normal(input_shape).astype("float32")
        classes = int(model(x[:1]).shape[-1])
        y = np.random.default_rng(1).integers(0, classes, input_shape[0])
        return ModelSizes(layers, *perfmodel.measure_keras(model, x, y, shown=_measuring),
                          adapter=adapter)
    if compute_s is None:
        raise SystemExit("give --compute-ms (forward+backward+optimizer per step) or --measure")
    return ModelSizes(layers, compute_s / 3, 2 * compute_s / 3, adapter=adapter)


# -- the table --------------------------------------------------------------------------------
def advise(model: ModelSizes, cluster: Cluster, family: str = "transformer",
           constants: Constants = perfmodel.CALIBRATED) -> dict[str, Any]:
    """Every technique's predicted step, bytes, memory, measured steps-to-target factor and
    predicted time to target (relative to Horovod), and the recommendation with its reason."""
    measured = MEASURED_STEPS.get(family, {})
    rows = []
    preds = perfmodel.predict_all(model, cluster, constants)
    base = next(p for p in preds if p.technique == "horovod")
    for p in preds:
        factor, source = steps_factor(measured, family, p.technique, cluster.ranks)
        # never credited with fewer steps than Horovod: below 1 on one bench workload is that
        # workload's luck (or noise), not something the technique brings elsewhere
        to_target = None if factor is None else p.step_s * max(factor, 1.0) / base.step_s
        rows.append(dict(prediction=p, steps_factor=factor, source=source,
                         time_to_target=to_target))
    rows += twolevel.rows(model, cluster, constants, family, measured, [
        p.technique for p in preds if p.technique.startswith("hvdsync") and p.technique
        in CANDIDATES or p.technique == "ddp post-local sgd"], base.step_s)
    by = {r["prediction"].technique: r for r in rows}
    known = [r for r in rows if _name(r) in CANDIDATES and r["time_to_target"] is not None]
    plain = min((by[t] for t in ("horovod", "horovod fp16")), key=lambda r: r["time_to_target"])
    best = min(known, key=lambda r: r["time_to_target"])
    share = 1 - base.compute_s / base.step_s
    if best["time_to_target"] > MARGIN * plain["time_to_target"]:
        best = plain
        reason = (f"communication is {share:.0%} of Horovod's step here; no technique is "
                  f"predicted to reach the target in {MARGIN:.0%} of "
                  f"{plain['prediction'].technique}'s time once its measured extra steps count")
    else:
        p: Prediction = best["prediction"]
        reason = (f"communication is {share:.0%} of Horovod's step; {p.technique} cuts the "
                  f"step to {p.step_s / base.step_s:.2f}x and needs "
                  f"{max(best['steps_factor'], 1.0):.2f}x the steps ({best['source']}): "
                  f"{best['time_to_target']:.2f}x Horovod's time")
    peers = [r for r in rows if r["prediction"].technique.startswith("ddp")
             and r["time_to_target"] is not None
             and r["time_to_target"] < MARGIN * best["time_to_target"]]
    if peers:
        peer = min(peers, key=lambda r: r["time_to_target"])
        reason += (f" ({peer['prediction'].technique} is predicted faster still, "
                   f"{peer['time_to_target']:.2f}x, outside Horovod)")
    return dict(rows=rows, recommended=best["prediction"].technique, reason=reason,
                horovod_step_s=base.step_s, passed_over=_passed_over(rows, best, family))


def _passed_over(rows: list[dict], best: dict, family: str) -> list[str]:
    """Why each row with a faster predicted step than the recommendation's is not it."""
    out = []
    for r in rows:
        p = r["prediction"]
        if r is best or p.step_s >= best["prediction"].step_s:
            continue
        if p.technique.startswith("ddp"):
            why = "a DDP peer, not a drop-in for Horovod's optimizer"
        elif _name(r) not in CANDIDATES:
            why = "not a communication technique (nothing on, or clip= for stability)"
        elif r["time_to_target"] is None:
            why = f"its steps to target for the {family} family: {r['source']}"
        elif r["time_to_target"] >= best["time_to_target"]:
            why = (f"needs {max(r['steps_factor'], 1.0):.2f}x the steps ({r['source']}): "
                   f"{r['time_to_target']:.2f}x Horovod's time to target")
        else:
            why = (f"{r['time_to_target']:.2f}x Horovod's time to target, not under {MARGIN:.0%} "
                   f"of {best['prediction'].technique}'s {best['time_to_target']:.2f}x: "
                   "within the model's error")
        out.append(f"{p.technique} ({p.step_s * 1e3:.1f} ms a step): {why}")
    return out


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def format_table(result: dict[str, Any]) -> str:
    head = ["technique", "step (ms)", "vs horovod", "bytes/step", "extra memory",
            "steps x (measured)", "time to target (x horovod)", "source"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in result["rows"]:
        p = r["prediction"]
        lines.append(" | ".join([
            p.technique, f"{p.step_s * 1e3:.1f}", f"{p.step_s / result['horovod_step_s']:.2f}",
            _human(p.bytes_per_step), _human(p.memory_bytes),
            "-" if r["steps_factor"] is None else f"{r['steps_factor']:.2f}",
            "-" if r["time_to_target"] is None else f"{r['time_to_target']:.2f}x",
            r["source"]]))
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """Bad input ends in one line naming the flag and what it accepts (exit code 2), never a
    traceback; the description wraps between words only (a path stays whole)."""

    def __init__(self, **kw: Any):
        super().__init__(formatter_class=_WholeWords, **kw)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


class _WholeWords(argparse.HelpFormatter):
    """argparse's help, its text wrapped without breaking a word at a hyphen
    (``docs/at-scale.md``)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


def _number(kind: type, low: float, strict: bool) -> Any:
    """An argparse type: a finite ``kind`` above ``low`` (``strict``) or at least ``low``."""
    def parse(text: str) -> Any:
        try:
            value = kind(float(text)) if kind is int and float(text).is_integer() else kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low or (strict and value == low):
            sign = ">" if strict else ">="
            raise argparse.ArgumentTypeError(
                f"takes {'an integer' if kind is int else 'a finite number'} {sign} {low:g}, "
                f"got {text!r}")
        return value
    parse.__name__ = kind.__name__  # what argparse names in its own messages
    return parse


_POSITIVE, _COUNT = _number(float, 0, True), _number(int, 0, True)


def _shape(text: str) -> tuple[int, ...]:
    """``--input-shape``: integers >= 1, comma-separated (``64,32``)."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"takes a batch's shape, integers >= 1 separated by "
                                         f"commas (e.g. 64,32), got {text!r}")
    return shape


def _rows(text: str) -> str:
    """``ROWS`` or ``NAME=ROWS,...`` with positive integer rows."""
    for part in text.split(","):
        rows = part.partition("=")[2] if "=" in part else part
        if not rows.strip().isdigit() or int(rows) < 1:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give ROWS or NAME=ROWS,... (positive integers)")
    return text


def _description() -> str:
    """The module doc's first paragraph, whole (argparse shows it under usage)."""
    text = " ".join(__doc__.split("::")[0].split()).replace("``", "")
    return re.sub(r":\w+:`([^`]*)`", r"\1", text)  # :mod:`x` -> x


def main(argv: Optional[list[str]] = None) -> None:
    ap = _Parser(prog="python -m hvdsync.tools.advise", description=_description())
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--preset", choices=["gpt-125m", "gpt-1.3b", "resnet50"])
    what.add_argument("--model", help="module:callable returning a torch module or Keras model")
    what.add_argument("--params", type=_POSITIVE, help="parameter count (sizes alone)")
    ap.add_argument("--layers", type=_COUNT, default=50, help="with --params: how many layers")
    ap.add_argument("--compute-ms", type=_POSITIVE,
                    help="forward+backward+optimizer per step on one rank")
    ap.add_argument("--input-shape", type=_shape,
                    help="with --model --measure: a batch's shape, e.g. 64,32")
    ap.add_argument("--measure", action="store_true", help="time one local step of --model")
    ap.add_argument("--embedding-rows", type=_rows,
                    help="with --model: rows a rank's batch touches per step in each "
                         "row-sparse embedding (ROWS, or NAME=ROWS,...); default: estimated "
                         "from --input-shape")
    ap.add_argument("--family", choices=list(MEASURED_STEPS), default=None,
                    help="which measured steps-to-target factors apply (default: the preset's, "
                         "else transformer)")
    ap.add_argument("--ranks", type=_COUNT, required=True)
    ap.add_argument("--ranks-per-node", type=_COUNT, default=1)
    ap.add_argument("--bandwidth", type=_POSITIVE, required=True,
                    help="Gbit/s per rank between nodes")
    ap.add_argument("--latency-us", type=_number(float, 0, False), default=20.0)
    ap.add_argument("--intra-bandwidth", type=_POSITIVE, default=600.0,
                    help="Gbit/s between ranks of a node")
    ap.add_argument("--tokens", type=_COUNT, default=16384,
                    help="presets: tokens per rank per step (transformers)")
    ap.add_argument("--images", type=_COUNT, default=256,
                    help="presets: images per rank per step (ResNet-50)")
    ap.add_argument("--device-tflops", type=_POSITIVE, default=400.0,
                    help="presets: achieved TFLOP/s per rank (400: an H100 at ~40%% of peak)")
    ap.add_argument("--constants", choices=["gpu", "bench"], default="gpu",
                    help="gpu (default): an NCCL GPU cluster, assumed; bench: fitted on this "
                         "project's bench bed (CPU ranks over Gloo, collectives at most ~1 "
                         "Gbit/s)")
    args = ap.parse_args(argv)
    try:
        _advise(args)
    except (ValueError, ImportError, AttributeError, SystemExit) as e:
        if isinstance(e, SystemExit) and not isinstance(e.code, str):
            raise
        ap.error(str(e.code if isinstance(e, SystemExit) else e))


def _advise(args: argparse.Namespace) -> None:
    family, notes = args.family, []
    if args.preset:
        p = presets(args.tokens, args.images)[args.preset]
        compute = p.flops_per_step / (args.device_tflops * 1e12)
        sizes = ModelSizes(p.layers, compute / 3, 2 * compute / 3)
        family = family or p.family
        title = p.what
    elif args.model:
        model = _load(args.model)
        rows, notes = embedding_rows(model, args.embedding_rows, args.input_shape)
        sizes = sizes_from_module(model, args.input_shape, args.measure,
                                  None if args.compute_ms is None else args.compute_ms / 1e3,
                                  rows)
        family = family or ("embedding" if rows else None)  # (sparse= measured there only)
        title = args.model
    else:
        if args.compute_ms is None:
            raise ValueError("--params needs --compute-ms")
        if args.layers > args.params:
            raise ValueError(f"--layers {args.layers} is more than --params {args.params:g}")
        per = int(args.params // args.layers)
        side = max(1, int(math.sqrt(per)))
        layers = tuple(LayerSize(f"layer{i}", per, ((side, per // side),))
                       for i in range(args.layers))
        sizes = ModelSizes(layers, args.compute_ms / 3e3, 2 * args.compute_ms / 3e3)
        title = f"{args.params:.3g} parameters in {args.layers} layers"
    family = family or "transformer"
    constants = {"gpu": GPU_CLUSTER, "bench": perfmodel.CALIBRATED}[args.constants]
    cluster = Cluster(ranks=args.ranks, bandwidth_gbit=args.bandwidth,
                      latency_us=args.latency_us, ranks_per_node=args.ranks_per_node,
                      intra_bandwidth_gbit=args.intra_bandwidth)
    result = advise(sizes, cluster, family, constants)
    print(f"{title}: {sizes.params / 1e6:.1f}M parameters, {sizes.compute_s * 1e3:.1f} ms "
          f"compute per step; {args.ranks} ranks ({args.ranks_per_node} per node), "
          f"{args.bandwidth:g} Gbit/s between nodes; constants: "
          f"{'assumed GPU cluster' if constants is GPU_CLUSTER else 'fitted on the bench bed'}")
    print(format_table(result))
    for note in notes:
        print(f"note: {note}")
    print(f"\nrecommended: {result['recommended']} -- {result['reason']}")
    for line in result["passed_over"]:
        print(f"  passed over: {line}")
    print("(predictions: docs/at-scale.md; steps-to-target factors are measured on the bench "
          f"bed for the {family} family, not predicted)")
    print(f"\nto turn it on:\n    {line_to_paste(result['recommended'])}")


if __name__ == "__main__":
    main(sys.argv[1:])
