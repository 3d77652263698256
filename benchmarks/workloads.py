"""The benchmark workloads: learnable data available offline, a model, an optimizer.

* ``digits_mlp``: scikit-learn's bundled digits, each rank sampling batches from its shard;
  the 3-layer MLP of ``examples/torch/train_digits.py`` with momentum SGD.
* ``teacher_cnn``: 16x16 Gaussian images labelled by a fixed random convolutional teacher
  (planted: the task has an exact answer); a 5-conv-layer student CNN with Adam.
* ``teacher_resnet``: the same data; a ResNet with BatchNorm (3 stages of 2 basic blocks,
  32/64/64 channels, 1.2 MiB of float32 gradient) with momentum SGD: a small gradient that a
  slow link still makes the step's largest part.
* ``zipf_embedding``: bags of Zipf-distributed ids labelled by a planted teacher
  (``examples/torch/train_zipf_embeddings.py``) with a 10k x 32 ``EmbeddingBag`` (sparse
  gradients) and momentum SGD.

* ``stdlib_lm``: a byte-level GPT-style transformer (4 blocks, width 128, context 128) on the
  Python standard library's own sources (real text that ships with every Python); the metric
  is the validation loss (next-byte cross-entropy) on the held-out last 5 % of the corpus.

Every rank draws its own data stream; the held-out set is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


#: each held-out metric's axis label
METRIC_LABEL = {"accuracy": "held-out accuracy %", "loss": "validation loss (nats/byte)"}


def as_shown(metric: str, score: float, spread: bool = False) -> float:
    """A score (higher is better) as the metric reads: accuracy in %, or the loss; a spread
    of scores as a spread of that."""
    if metric == "loss":
        return score if spread else -score
    return 100 * score


@dataclass
class Workload:
    name: str
    make_model: Callable[[bool], nn.Module]  # (sparse embeddings?) -> model
    make_optimizer: Callable[[nn.Module, int], torch.optim.Optimizer]  # (model, world size)
    batches: Callable[[int, int, int], Callable[[], tuple]]  # (rank, size, seed) -> next()
    test_set: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # seed -> (x, y)
    steps: int
    eval_every: int
    has_sparse: bool = False
    #: the held-out metric: "accuracy" (higher is better) or "loss" (cross-entropy in nats per
    #: token, lower is better); compared as a score, higher is better (minus the loss)
    metric: str = "accuracy"

    def score(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        """The held-out metric as a score, higher is better."""
        with torch.no_grad():
            out = model(x)
            if self.metric == "loss":
                return -nn.functional.cross_entropy(out, y).item()
            return (out.argmax(1) == y).float().mean().item()

    @property
    def tolerance(self) -> float:
        """How far below the baseline's score still counts as reaching it: about one
        standard error of the held-out metric (0.5 point of accuracy; 0.01 nats)."""
        return 0.01 if self.metric == "loss" else 0.005

    def show(self, score: float, spread: bool = False) -> str:
        """A score (or a spread of scores) as the metric reads: accuracy in %, loss."""
        return f"{as_shown(self.metric, score, spread):.{3 if self.metric == 'loss' else 2}f}"


# -- digits MLP -------------------------------------------------------------------------------
def _digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    return train_test_split(x, d.target, test_size=0.25, random_state=0, stratify=d.target)


def _digits_batches(rank: int, size: int, seed: int, batch: int = 32):
    x_train, _, y_train, _ = _digits()
    x = torch.from_numpy(x_train[rank::size])
    y = torch.from_numpy(y_train[rank::size])
    g = torch.Generator().manual_seed(seed * 1000 + rank)

    def next_batch():
        idx = torch.randint(len(x), (batch,), generator=g)
        return x[idx], y[idx]
    return next_batch


def _digits_test(seed: int):
    _, x_test, _, y_test = _digits()
    return torch.from_numpy(x_test), torch.from_numpy(y_test)


DIGITS = Workload(
    "digits_mlp",
    lambda sparse: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                                 nn.Linear(64, 10)),
    lambda m, size: torch.optim.SGD(m.parameters(), lr=0.05 * size, momentum=0.9),
    _digits_batches, _digits_test, steps=240, eval_every=20)


# -- planted-teacher CNN ----------------------------------------------------------------------
class _ConvTeacher:
    """A fixed random conv net labelling 1x16x16 Gaussian images into 10 classes."""

    def __init__(self, seed: int = 4321):
        g = torch.Generator().manual_seed(seed)
        self.conv = torch.randn(8, 1, 5, 5, generator=g) / 5.0
        self.lin = torch.randn(8 * 4 * 4, 10, generator=g) / 8.0

    @torch.no_grad()
    def label(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(nn.functional.conv2d(x, self.conv, padding=2))
        h = nn.functional.avg_pool2d(h, 4).flatten(1)
        return (h @ self.lin).argmax(1)


def _student_cnn(sparse: bool) -> nn.Module:
    c = 32
    return nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(),
        nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(2 * c * 16, 64), nn.ReLU(), nn.Linear(64, 10))


def _teacher_batches(rank: int, size: int, seed: int, batch: int = 32):
    teacher = _ConvTeacher()
    g = torch.Generator().manual_seed(seed * 1000 + rank)

    def next_batch():
        x = torch.randn(batch, 1, 16, 16, generator=g)
        return x, teacher.label(x)
    return next_batch


def _teacher_test(seed: int):
    x = torch.randn(2000, 1, 16, 16, generator=torch.Generator().manual_seed(10**6 + seed))
    return x, _ConvTeacher().label(x)


TEACHER_CNN = Workload(
    "teacher_cnn", _student_cnn,
    lambda m, size: torch.optim.Adam(m.parameters(), lr=1e-3),
    _teacher_batches, _teacher_test, steps=300, eval_every=25)


class _Block(nn.Module):
    """A basic residual block: conv-BN-ReLU-conv-BN plus the input (a 1x1 conv where the
    shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = (nn.Sequential() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.skip(x))


def _resnet(sparse: bool) -> nn.Module:
    blocks, c_in = [], 32
    for c, stride in ((32, 1), (32, 1), (64, 2), (64, 1), (64, 2), (64, 1)):
        blocks.append(_Block(c_in, c, stride))
        c_in = c
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32),
                         nn.ReLU(), *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, 10))


TEACHER_RESNET = Workload(
    "teacher_resnet", _resnet,
    lambda m, size: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    _teacher_batches, _teacher_test, steps=300, eval_every=25)


# -- Zipf embedding bags ------------------------------------------------------------------------
VOCAB, DIM = 10000, 32


def _zipf_data():
    from examples.torch.train_zipf_embeddings import ZipfTeacherData
    return ZipfTeacherData(vocab=VOCAB, bag=16)


def _zipf_model(sparse: bool) -> nn.Module:
    from examples.torch.train_zipf_embeddings import BagClassifier
    m = BagClassifier(VOCAB, dim=DIM, hidden=64)
    if not sparse:  # PowerSGD (DDP) needs dense gradients
        m.embedding.sparse = False
    return m


def _zipf_batches(rank: int, size: int, seed: int, batch: int = 64):
    data = _zipf_data()
    rng = np.random.default_rng([seed, rank])
    return lambda: data.batch(rng, batch)


def _zipf_test(seed: int):
    return _zipf_data().batch(np.random.default_rng([seed, 10**6]), 4000)


ZIPF = Workload(
    "zipf_embedding", _zipf_model,
    lambda m, size: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9),
    _zipf_batches, _zipf_test, steps=300, eval_every=25, has_sparse=True)

# -- byte-level GPT on the Python standard library's sources ----------------------------------
CONTEXT, LM_DIM, LM_LAYERS, LM_HEADS = 128, 128, 4, 4
_CORPUS: list = []


def _corpus() -> torch.Tensor:
    """The standard library's own ``.py`` files (they ship with every Python: real text,
    offline), sorted by path, as bytes; the first 8 MiB."""
    if not _CORPUS:
        import sysconfig
        from pathlib import Path
        root = Path(sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for path in sorted(root.rglob("*.py")):
            if "site-packages" in path.parts or "test" in path.parts:
                continue
            data = path.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= 8 << 20:
                break
        _CORPUS.append(torch.frombuffer(bytearray(b"".join(chunks)[:8 << 20]),
                                        dtype=torch.uint8).long())
    return _CORPUS[0]


class TinyGPT(nn.Module):
    """A GPT-style decoder over bytes (vocabulary 256): token and position embeddings,
    ``LM_LAYERS`` pre-norm blocks of causal self-attention and an MLP, a tied-free head.
    About 0.9 M parameters: at 100 Mbit/s one step's gradient exchange (3.5 MB, ~0.28 s) takes
    about four times its compute on one core (~70 ms for a batch of 4 x 128 bytes, forward,
    backward and AdamW): communication is the bottleneck, as on GPUs behind a slow link.
    Returns next-byte logits flattened to (batch x time, 256)."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(256, LM_DIM)
        self.pos = nn.Embedding(CONTEXT, LM_DIM)
        layer = nn.TransformerEncoderLayer(LM_DIM, LM_HEADS, 4 * LM_DIM, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LM_LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(LM_DIM)
        self.head = nn.Linear(LM_DIM, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h)).reshape(-1, 256)


def _lm_windows(data: torch.Tensor, starts: torch.Tensor) -> tuple:
    idx = starts[:, None] + torch.arange(CONTEXT + 1)
    w = data[idx]
    return w[:, :-1], w[:, 1:].reshape(-1)


def _lm_batches(rank: int, size: int, seed: int, batch: int = 4):
    data = _corpus()
    train = data[: int(len(data) * 0.95)]
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return lambda: _lm_windows(train, torch.randint(len(train) - CONTEXT - 1, (batch,),
                                                    generator=g))


def _lm_test(seed: int):
    data = _corpus()
    held = data[int(len(data) * 0.95):]
    g = torch.Generator().manual_seed(10**6 + seed)
    return _lm_windows(held, torch.randint(len(held) - CONTEXT - 1, (64,), generator=g))


STDLIB_LM = Workload(
    "stdlib_lm", lambda sparse: TinyGPT(),
    lambda m, size: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01),
    _lm_batches, _lm_test, steps=300, eval_every=25, metric="loss")


WORKLOADS = {w.name: w for w in (DIGITS, TEACHER_CNN, TEACHER_RESNET, ZIPF, STDLIB_LM)}
