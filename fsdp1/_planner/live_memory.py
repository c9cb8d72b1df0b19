"""Exact tensor memory on any device, CPU included: the bytes of tensor storage alive, and their peak.

``LiveStorageTracker`` is a dispatch mode that records the storage of every tensor an operator
returns and forgets it when the storage is freed. Three things make it exact for FSDP-style code,
where a naive count of operator outputs is not:

* FSDP frees and refills unsharded buffers with ``UntypedStorage.resize_``, which is not an operator,
  so the tracker wraps that method while it is active;
* a tensor subclass such as DTensor owns inner tensors created below the dispatch mode, so the
  tracker counts the inner tensors and never the wrapper;
* only storages allocated while it is active count: an operator output that shares an input's storage
  (a view, ``.data``, an in-place result) is not new memory, even when that storage predates the
  tracker. Enter it before building the model when buffers hidden inside a wrapper (DDP's gradient
  buckets) should count.

Collective backends' own staging buffers and allocator caches are invisible to it by design.
"""

import weakref
from typing import Any, Dict, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _storages(tree: Any) -> Iterator[torch.UntypedStorage]:
    """The storages of the plain tensors in ``tree``, looking inside tensor subclasses."""
    for leaf in tree_leaves(tree):
        if not isinstance(leaf, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(leaf):
            inner_names, _ = leaf.__tensor_flatten__()
            yield from _storages([getattr(leaf, name) for name in inner_names])
        else:
            yield leaf.untyped_storage()


class LiveStorageTracker(TorchDispatchMode):
    """Counts live storage bytes from ``__enter__`` on; ``peak`` is the high-water mark since the last
    ``reset_peak()``."""

    def __init__(self) -> None:
        super().__init__()
        self._nbytes: Dict[int, int] = {}  # StorageImpl address -> bytes
        self.live = 0
        self.peak = 0
        self._original_resize = torch.UntypedStorage.resize_

    def reset_peak(self) -> None:
        self.peak = self.live

    def __enter__(self) -> "LiveStorageTracker":
        tracker, original = self, self._original_resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._original_resize
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {s._cdata for s in _storages((args, kwargs))}
        out = func(*args, **kwargs)
        for storage in _storages(out):
            if storage._cdata not in inputs:
                self._track(storage)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._nbytes:
            return
        self._nbytes[key] = 0
        self._set(key, storage.nbytes())
        weakref.finalize(storage, self._set, key, 0, True)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        if storage._cdata in self._nbytes:
            self._set(storage._cdata, storage.nbytes())

    def _set(self, key: int, nbytes: int, forget: bool = False) -> None:
        self.live += nbytes - self._nbytes.get(key, 0)
        self.peak = max(self.peak, self.live)
        if forget:
            self._nbytes.pop(key, None)
        else:
            self._nbytes[key] = nbytes
