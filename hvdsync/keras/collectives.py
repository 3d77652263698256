"""The few collectives ``hvdsync.keras``'s callbacks make, on the engine of Keras' backend:
Horovod's TensorFlow ops (TensorFlow backend), or hvdsync.torch's engine -- torch.distributed
or Horovod -- on the torch backend. The callbacks' own code is the same on both."""

from __future__ import annotations

from typing import Any

import keras


def _on_torch() -> bool:
    return keras.backend.backend() == "torch"


def global_set() -> Any:
    """The process set of every rank."""
    if _on_torch():
        import hvdsync.torch as hvd
        return hvd.global_process_set
    from horovod.tensorflow.mpi_ops import global_process_set
    return global_process_set


def broadcast(x: Any, root_rank: int, name: str, process_set: Any) -> Any:
    """``x`` (a tensor of the backend) as ``root_rank`` has it."""
    if _on_torch():
        import hvdsync.torch as hvd
        return hvd.broadcast(x, root_rank, name=name, process_set=process_set)
    from horovod.tensorflow import mpi_ops
    return mpi_ops.broadcast(x, root_rank, name=name, process_set=process_set)


def average(values: list[float], name: str, process_set: Any) -> list[float]:
    """The ranks' average of ``values``, in float64."""
    if _on_torch():
        import torch

        import hvdsync.torch as hvd
        return hvd.allreduce(torch.tensor(values, dtype=torch.float64), name=name,
                             op=hvd.Average, process_set=process_set).tolist()
    import tensorflow as tf
    from horovod.tensorflow import mpi_ops
    return mpi_ops._allreduce(tf.constant(values, tf.float64), name=name, op=mpi_ops.Average,
                              process_set=process_set).numpy().tolist()


def gather_json(obj: Any, name: str, process_set: Any) -> list:
    """Every rank's ``obj`` (JSON data), in rank order."""
    if _on_torch():
        import hvdsync.torch as hvd
        # (Horovod's own allgather_object takes no process set: the global one it is)
        own = {} if process_set is hvd.global_process_set else dict(process_set=process_set)
        return hvd.allgather_object(obj, name=name, **own)
    from hvdsync.keras.comm import gather_json as gather
    return gather(obj, name, process_set)


def gather_bytes(data: bytes, name: str, process_set: Any) -> list[bytes]:
    """Every rank's ``data``, in rank order."""
    if _on_torch():
        from hvdsync.torch.functions import gather_bytes as gather
    else:
        from hvdsync.keras.comm import gather_bytes as gather
    return gather(data, name, process_set)
