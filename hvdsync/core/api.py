"""hvdsync's own API on a wrapped optimizer, the same in torch and Keras (the adapters' wrapper
classes mix it in; Horovod's API is the adapters' own)."""

from __future__ import annotations

from typing import Any, Optional

from hvdsync.core.pipeline import StepPipeline
from hvdsync.core.technique import Technique


class SyncAPI:
    """``techniques``, ``flush()``, ``send_times`` and each technique's status."""

    def _sync_pipeline(self) -> Optional[StepPipeline]:
        """The step pipeline (``None`` while a Keras optimizer is not built yet)."""
        raise NotImplementedError

    def _sync_included(self) -> bool:
        """Whether this rank takes part in the optimizer's process set."""
        raise NotImplementedError

    @property
    def techniques(self) -> dict[str, Technique]:
        """The configured techniques by name, in pipeline order (read-only use: their
        ``policy``, memory and ``status()``): one per keyword, and ``delay=``'s
        synchronization of the models after the update as ``outer``."""
        pipeline = self._sync_pipeline()
        if pipeline is None:
            return {}
        return {t.name: t for t in pipeline.techniques if t.name != "plain"}

    def flush(self) -> int:
        """Make every replica identical now, e.g. before evaluating or saving, or at the end
        of training. With ``delay=``: wait for every outstanding global gradient and average
        the parameters -- and, with ``optimizer_state="average"``, the optimizer state (the
        outer synchronization: merge every fragment in flight, then average). With
        ``threshold=``: synchronize every layer that is skipping, as its due sync would (back
        to its sync point, one optimizer step with the ranks' reduced accumulation; no step
        is counted). Call it on every rank, outside the training step: it is a collective
        unless nothing is pending.

        The outstanding global gradients are not folded in as another optimizer step: the
        averaged parameters already hold every rank's local contribution of those steps,
        whose average is their global gradient. Returns how many this rank dropped (also
        counted as ``discarded`` in ``stats``). Without ``delay=`` it returns 0.
        """
        pipeline = self._sync_pipeline()
        if pipeline is None or not self._sync_included():
            return 0
        dropped = pipeline.flush_replicas()
        self._state_changed()
        return dropped

    def _state_changed(self) -> None:
        """The techniques' state changed outside a step (a tracing adapter's compiled step
        reads some of it from device variables: write them)."""

    @property
    def _configured(self) -> list[Technique]:
        return list(self.techniques.values())

    def _status(self, name: str) -> dict[str, Any]:
        pipeline = self._sync_pipeline()
        return pipeline.status(name) if pipeline is not None else {}

    @property
    def selection(self) -> dict[str, list]:
        """With ``select=``: the last step's per-layer ``scores``, rank-averaged
        ``residual_norms`` and (hypernet) ``dots`` and ``alpha``, and the layers chosen for the
        next step (``next``, layer names). Empty without ``select=``."""
        return self._status("select")

    @property
    def delay_status(self) -> dict[str, Any]:
        """With ``delay=``: finished ``step`` count, ids (step numbers) of the ``outstanding``
        global gradients, the ids the last step folded in (``last_folded``, newest first) and
        the ``staleness`` histogram ``{lag in steps: count}``; with the outer synchronization
        also ``outer``: the ``fragments`` (layer indices), the fragments ``in_flight`` and those
        the last step merged (``last_merged``). Empty without ``delay=``."""
        status, outer = self._status("delay"), self._status("outer")
        return {**status, "outer": outer} if outer else status

    @property
    def sparse_routes(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
        """With ``sparse=``: per parameter (variable) name, the last step's route, per-rank
        distinct-row counts and the rows handed to the optimizer (duplicates across ranks
        summed). Empty without ``sparse=``."""
        return self._status("sparse")

    @property
    def send_times(self) -> list[tuple[str, float]]:
        """``(layer name, time.perf_counter())`` when each layer's send started in the current
        step (or the last one): shows sends overlapping backward (torch)."""
        pipeline = self._sync_pipeline()
        return list(pipeline.send_times) if pipeline is not None else []
