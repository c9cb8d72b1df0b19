"""Exact tensor memory on any device, CPU and meta included: the bytes of tensor storage alive, and their peak.

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

The planner also asks what the peak would have been had some storages lived elsewhere (CPU offload
keeps the shards, their gradients and the optimizer state in host memory, while the dry run keeps
everything on the meta device): with ``record=True`` every change of a storage's size is logged
under a serial number that a reused address cannot confuse, and ``peak_without`` replays the log
leaving those storages out.

Collective backends' own staging buffers and allocator caches are invisible to it by design.
"""

import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Set, Tuple

import torch

from .._torch_internals import TorchDispatchMode, is_traceable_wrapper_subclass, storage_key, tree_leaves


def storages(tree: Any) -> Iterator[torch.UntypedStorage]:
    """The storages of the plain tensors in ``tree``, looking inside tensor subclasses."""
    for leaf in tree_leaves(tree):
        if not isinstance(leaf, torch.Tensor):
            continue
        if bool(is_traceable_wrapper_subclass(leaf)):  # typed as a test no Tensor passes
            inner_names, _ = leaf.__tensor_flatten__()  # type: ignore[attr-defined]  # a traceable wrapper subclass
            yield from storages([getattr(leaf, name) for name in inner_names])
        else:
            yield leaf.untyped_storage()


class LiveStorageTracker(TorchDispatchMode):
    """Counts live storage bytes from ``__enter__`` on; ``peak`` is the high-water mark since the last
    ``reset_peak()``."""

    def __init__(self, record: bool = False) -> None:
        super().__init__()
        self._nbytes: Dict[int, int] = {}  # StorageImpl address -> bytes
        self._serials: Dict[int, int] = {}  # StorageImpl address -> serial of the storage alive there
        self._events: List[Tuple[int, int]] = []  # (serial, bytes from then on), when recording
        self._next_serial = 0
        self._record = record
        self._peak_from = 0  # the event from which the replayed peak counts
        self.live = 0
        self.peak = 0
        self._original_resize: Callable[..., Any] = torch.UntypedStorage.resize_

    def reset_peak(self) -> None:
        self.peak = self.live
        self._peak_from = len(self._events)

    def serials_of(self, tree: Any) -> Set[int]:
        """The serial numbers of the storages of the tensors in ``tree`` that this tracker counts."""
        return {self._serials[storage_key(s)] for s in storages(tree) if storage_key(s) in self._serials}

    def peak_without(self, excluded: Iterable[int]) -> int:
        """The peak since ``reset_peak()`` had the storages of serial numbers ``excluded`` not counted
        (needs ``record=True``)."""
        assert self._record, "peak_without needs a tracker made with record=True"
        excluded = set(excluded)
        sizes: Dict[int, int] = {}
        live = peak = 0
        for index, (serial, nbytes) in enumerate(self._events):
            if index == self._peak_from:
                peak = live
            if serial not in excluded:
                live += nbytes - sizes.get(serial, 0)
                sizes[serial] = nbytes
            peak = max(peak, live)
        return peak if self._peak_from < len(self._events) else live

    def __enter__(self) -> "LiveStorageTracker":
        tracker, original = self, self._original_resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]  # restored by __exit__
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]  # the method it replaced
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        untracked = [s for s in storages(out) if storage_key(s) not in self._nbytes]  # views and in-place results are not
        if untracked:
            inputs = {storage_key(s) for s in storages((args, kwargs))}  # an input that predates the tracker is not new
            for storage in untracked:
                if storage_key(storage) not in inputs:
                    self._track(storage)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage_key(storage)
        if key in self._nbytes:
            return
        self._nbytes[key] = 0
        self._serials[key] = serial = self._next_serial
        self._next_serial += 1
        self._set(key, storage.nbytes())
        weakref.finalize(storage, self._forget, key, serial)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        if storage_key(storage) in self._nbytes:
            self._set(storage_key(storage), storage.nbytes())

    def _forget(self, key: int, serial: int) -> None:
        if self._serials.get(key) == serial:
            self._set(key, 0)
            self._nbytes.pop(key, None)
            self._serials.pop(key, None)

    def _set(self, key: int, nbytes: int) -> None:
        self.live += nbytes - self._nbytes.get(key, 0)
        self.peak = max(self.peak, self.live)
        self._nbytes[key] = nbytes
        if self._record:
            self._events.append((self._serials[key], nbytes))
