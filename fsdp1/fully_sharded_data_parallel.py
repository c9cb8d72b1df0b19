"""torch's path of the FSDP1 module, ``torch.distributed.fsdp.fully_sharded_data_parallel``.

The class lives in the FSDP1 front (``_wrapper``); it reports this module as its home so that its
name in reprs, pickles and ``type(module).__module__`` is the public one, wherever the front keeps it.
"""

from ._wrapper.fully_sharded_data_parallel import FullyShardedDataParallel, OptimStateKeyType

__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]

FullyShardedDataParallel.__module__ = OptimStateKeyType.__module__ = __name__
