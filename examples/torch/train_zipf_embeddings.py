"""Data-parallel training of an embedding model on Zipf-distributed ids with hvdsync's sparse
exchange (row-sparse gradients from ``nn.EmbeddingBag(sparse=True)``).

    horovodrun -np 2 -H localhost:2 --gloo python examples/torch/train_zipf_embeddings.py
    horovodrun -np 2 -H localhost:2 --gloo python examples/torch/train_zipf_embeddings.py --horovod

The data is synthetic but learnable: each example is a bag of ids drawn from a Zipf law over
the vocabulary, labelled by a planted teacher (every id has a hidden score; the label is the
quartile of the bag's mean score). ``--horovod`` uses Horovod's own sparse path instead, for
comparison. Rank 0 prints held-out accuracy and the communication stats.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

import hvdsync.torch as hvd

if __package__ in (None, ""):  # run as a script: make the examples package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.torch.loop import fit_steps  # noqa: E402

CLASSES = 4


def zipf_ids(n: int, vocab: int, exponent: float, rng: np.random.Generator,
             permutation: np.ndarray) -> np.ndarray:
    """``n`` ids with P(rank k) proportional to 1/k**exponent over a finite vocabulary; the
    popular ids are scattered over the table by ``permutation``."""
    weights = 1.0 / np.arange(1, vocab + 1) ** exponent
    return permutation[rng.choice(vocab, size=n, p=weights / weights.sum())]


class ZipfTeacherData:
    """Bags of Zipf ids labelled by a planted teacher; one generator per rank."""

    def __init__(self, vocab: int = 1000, bag: int = 16, exponent: float = 1.0,
                 seed: int = 1234):
        self.vocab, self.bag, self.exponent = vocab, bag, exponent
        teacher = np.random.default_rng(seed)
        self.permutation = teacher.permutation(vocab)
        self.scores = teacher.standard_normal(vocab)
        # Class edges: quartiles of the bag mean score under the data distribution.
        probe = self._bags(teacher, 20000)
        self.edges = np.quantile(self.scores[probe].mean(1), [0.25, 0.5, 0.75])

    def _bags(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return zipf_ids(n * self.bag, self.vocab, self.exponent, rng,
                        self.permutation).reshape(n, self.bag)

    def batch(self, rng: np.random.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self._bags(rng, n)
        labels = np.searchsorted(self.edges, self.scores[ids].mean(1))
        return torch.from_numpy(ids), torch.from_numpy(labels)


class BagClassifier(nn.Module):
    def __init__(self, vocab: int, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab, dim, mode="mean", sparse=True)
        self.hidden = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.embedding(ids))))


def train(steps: int = 400, batch_size: int = 64, lr: float = 0.5, seed: int = 0,
          sparse: Any = True, horovod: bool = False, vocab: int = 1000,
          verbose: bool = True) -> dict[str, Any]:
    """Train on this rank's stream of batches; return held-out accuracy, loss and stats.

    ``horovod=True`` wraps with ``horovod.torch.DistributedOptimizer`` (Horovod's sparse
    path) instead of hvdsync's; ``sparse`` is hvdsync's ``sparse=`` argument.
    """
    hvd.init()
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    say = print if verbose and hvd.rank() == 0 else (lambda *a, **k: None)
    data = ZipfTeacherData(vocab=vocab)
    rng = np.random.default_rng([seed, hvd.rank()])
    x_test, y_test = data.batch(np.random.default_rng([seed, 10**6]), 2000)

    model = BagClassifier(vocab)
    base = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if horovod:
        import horovod.torch
        opt = horovod.torch.DistributedOptimizer(base, named_parameters=model.named_parameters())
    else:
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       sparse=sparse)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    acc, loss = fit_steps(model, opt, lambda: data.batch(rng, batch_size), steps, x_test,
                          y_test, say)
    stats: Optional[dict] = None
    if not horovod:
        say(opt.stats.summary())
        stats = opt.stats.as_dict()
    return dict(accuracy=acc, loss=loss, stats=stats,
                params={n: p.detach().clone() for n, p in model.named_parameters()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=64, help="bags per rank per step")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--dense-ratio", type=float, default=1.0,
                    help="send a table dense when gathering would exceed this x its size")
    ap.add_argument("--horovod", action="store_true", help="use Horovod's own sparse path")
    args = ap.parse_args()
    train(args.steps, args.batch_size, args.lr, args.seed, dict(dense_ratio=args.dense_ratio),
          args.horovod, args.vocab)


if __name__ == "__main__":
    main()
