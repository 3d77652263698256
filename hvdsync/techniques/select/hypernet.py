"""``select=``'s default scorer: a small MLP in float64 numpy, the same on every rank (it is
trained on rank-averaged statistics only). docs/select.md, "The hypernet"."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np


def saved_floats(value: Any) -> np.ndarray:
    """A saved value as float64 numpy: from numpy, a list, or a framework tensor (torch's
    ``state_dict()`` holds tensors, which load without unpickling anything)."""
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        value = value.numpy()
    return np.array(value, dtype=float)


class Hypernet:
    """The scorer: [embedding, features] -> tanh -> tanh -> sigmoid, trained with Adam on
    ``dL/dalpha`` (float64 numpy: a few hundred parameters, not worth a device).
    ``features``: the number of per-step input statistics next to the learned embedding
    (0: the embedding alone)."""

    def __init__(self, num_layers: int, embed_dim: int, hidden: int, lr: float, seed: int,
                 features: int = 0):
        rng = np.random.default_rng(seed)

        def layer(n_in: int, n_out: int) -> np.ndarray:
            return rng.standard_normal((n_in, n_out)) / math.sqrt(n_in)
        self.embed_dim = embed_dim
        self.features = np.zeros(features)  # the inputs of the last step
        self.params = {"embedding": rng.standard_normal(embed_dim),
                       "w1": layer(embed_dim + features, hidden), "b1": np.zeros(hidden),
                       "w2": layer(hidden, hidden), "b2": np.zeros(hidden),
                       "w3": layer(hidden, num_layers) * 0.1, "b3": np.zeros(num_layers)}
        self.lr = lr
        self.m = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.t = 0

    def forward(self) -> tuple[np.ndarray, tuple]:
        p = self.params
        x = np.concatenate([p["embedding"], self.features])
        h1 = np.tanh(x @ p["w1"] + p["b1"])
        h2 = np.tanh(h1 @ p["w2"] + p["b2"])
        alpha = 1.0 / (1.0 + np.exp(-(h2 @ p["w3"] + p["b3"])))
        return alpha, (x, h1, h2)

    def alpha(self) -> np.ndarray:
        return self.forward()[0]

    def step(self, dots: np.ndarray, curvature: Optional[np.ndarray] = None,
             features: Optional[np.ndarray] = None) -> np.ndarray:
        """One Adam step on the loss of the alpha-scaled model, whose gradient w.r.t. alpha
        is ``dots`` at alpha = 1 (``dL/dalpha_l = <g_l, theta_l>``); with ``curvature``
        (``d2L/dalpha_l^2`` estimates) the gradient of its second-order expansion at the
        current alpha, ``dots + curvature * (alpha - 1)``. ``features``: this step's inputs
        (they take effect for this step's forward pass). Returns the new alpha."""
        p = self.params
        if features is not None:
            self.features = np.asarray(features, dtype=float)
        alpha, (x, h1, h2) = self.forward()
        d_alpha = dots if curvature is None else dots + curvature * (alpha - 1.0)
        d_z3 = d_alpha * alpha * (1 - alpha)
        grads = {"w3": np.outer(h2, d_z3), "b3": d_z3}
        d_z2 = (p["w3"] @ d_z3) * (1 - h2 ** 2)
        grads.update(w2=np.outer(h1, d_z2), b2=d_z2)
        d_z1 = (p["w2"] @ d_z2) * (1 - h1 ** 2)
        grads.update(w1=np.outer(x, d_z1), b1=d_z1,
                     embedding=(p["w1"] @ d_z1)[:self.embed_dim])
        self.t += 1
        b1, b2, eps = 0.9, 0.999, 1e-8
        for k, g in grads.items():
            self.m[k] = b1 * self.m[k] + (1 - b1) * g
            self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
            m_hat = self.m[k] / (1 - b1 ** self.t)
            v_hat = self.v[k] / (1 - b2 ** self.t)
            p[k] = p[k] - self.lr * m_hat / (np.sqrt(v_hat) + eps)
        return self.alpha()

    def state_dict(self) -> dict:
        return {"params": {k: v.copy() for k, v in self.params.items()},
                "m": {k: v.copy() for k, v in self.m.items()},
                "v": {k: v.copy() for k, v in self.v.items()}, "t": self.t,
                "features": self.features.copy()}

    def load_state_dict(self, state: dict) -> None:
        for key in ("params", "m", "v"):
            for k, v in state[key].items():
                if getattr(self, key)[k].shape != np.shape(v):
                    raise ValueError(f"hypernet state {key}.{k} has shape {np.shape(v)}, "
                                     f"expected {getattr(self, key)[k].shape}")
        self.params = {k: saved_floats(v) for k, v in state["params"].items()}
        self.m = {k: saved_floats(v) for k, v in state["m"].items()}
        self.v = {k: saved_floats(v) for k, v in state["v"].items()}
        self.t = int(state["t"])
        self.features = saved_floats(state.get("features", self.features))
