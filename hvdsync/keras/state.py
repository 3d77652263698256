"""hvdsync's state in Keras' own saving: ``model.save()`` stores it beside the optimizer's
variables, ``load_model`` restores it (docs/checkpoints.md). Mixed into the wrapper."""

from __future__ import annotations

from typing import Any

import numpy as np

from hvdsync.safety import checkpoint


class SavedState:
    """Keras' ``save_own_variables``/``load_own_variables`` hooks with hvdsync's state beside
    the optimizer's variables, on either backend: over the wrapper's ``technique_state()``
    and ``_load_state(state)`` (or ``_hv.pending_state`` until it is built)."""

    def save_own_variables(self, store) -> None:
        super().save_own_variables(store)
        if self.built and self._configured:
            state = self.technique_state()
            every_rank = getattr(self._hv, "every_rank", None)  # hvd.save_model gathered them
            if every_rank is not None:
                state = checkpoint.with_every_rank(self._configured, state, every_rank)
            for key, value in checkpoint.pack_state(state).items():
                store[key] = value

    def load_own_variables(self, store) -> None:
        keys = list(store.keys())
        own = {k: store[k] for k in keys if k.startswith(checkpoint.STATE_KEY)}
        super().load_own_variables({k: store[k] for k in keys
                                    if not k.startswith(checkpoint.STATE_KEY)})
        if own:
            state = checkpoint.unpack_state({k: np.asarray(v) for k, v in own.items()})
            if self.built:
                self._load_state(state)
            else:
                self._hv.pending_state = state


class KerasCheckpointing(SavedState):
    """``technique_state()`` and what a restore must refresh, on the TensorFlow backend."""

    def technique_state(self) -> dict:
        """hvdsync's checkpoint entry for this optimizer (docs/checkpoints.md); what
        ``model.save()`` stores beside the optimizer's variables."""
        hv = self._hv
        return checkpoint.state_of(self._configured, hv.signatures, hv.process_set.rank(),
                                   hv.process_set.size())

    def _load_state(self, state: dict) -> None:
        hv = self._hv
        restored = checkpoint.load_into(self._configured, state, hv.signatures,
                                        hv.process_set.rank(), hv.process_set.size())
        self._after_restore(restored)

    def _state_changed(self) -> None:
        _refresh_traced(self._hv)

    def _after_restore(self, restored_own: bool) -> None:
        """The next step checks that every rank restored the same shared state (pipeline's
        ``after_load``); the compiled step reads the restored state (``_refresh_traced``)."""
        hv = self._hv
        hv.pipeline.after_load(restored_own)
        hv.restored.assign(True)  # the compiled step checks it (the eager one by itself)
        _refresh_traced(hv)

    def take_shared_state(self, root_rank: int = 0) -> None:
        """Every rank takes ``root_rank``'s shared technique state and drops its own memory
        (warned where it held any; ``checkpoint.take_shared``): what Horovod Elastic's sync
        does, and what a checkpoint loaded on ``root_rank`` only needs. A collective."""
        from horovod.tensorflow.functions import broadcast_object
        hv = self._hv
        ps = hv.process_set
        if not self.built or not self._configured or ps.size() == 1:
            return
        checkpoint.take_shared(
            self._configured, hv.signatures, ps.rank(), ps.size(), root_rank,
            lambda obj: broadcast_object(obj, root_rank, name="hvdsync.techniques",
                                         process_set=ps))
        # every rank holds the same shared state and no memory of its own now: nothing is
        # left for the after-restore check to compare (a pending one is superseded; in the
        # compiled step it would run beside the step's memory updates, not before them)
        hv.pipeline.after_load(None)
        hv.restored.assign(False)
        _refresh_traced(hv)


def _refresh_traced(hv: Any) -> None:
    """The technique state changed on the host: the variables the compiled step reads it by
    (the techniques' host flags: a decider's plan among them)."""
    if hv.flags is not None:
        hv.flags.refresh()
