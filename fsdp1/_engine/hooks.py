"""The small helpers a unit's hooks run under: eagerly under ``torch.compile`` (``eager_only``,
``eager_hook``), holding their unit weakly (``WeakPartial``), and knowing whether autograd is running
a backward (``inside_backward``)."""

import functools
import sys
import weakref
from typing import Any, Callable, List, TypeVar

import torch

from .._torch_internals import current_graph_task_id

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def eager_only(fn: _Fn) -> _Fn:
    """Run ``fn`` outside any ``torch.compile`` graph: dynamo breaks the graph at the call and runs it
    eagerly (its collectives, storage resizes and hook registrations cannot be traced). Dynamo is
    only asked once it is loaded, so eager use never pays its import (about 2 s here)."""
    disabled: List[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn, recursive=True))
        return disabled[0](*args, **kwargs)

    return call  # type: ignore[return-value]  # same signature as fn


def eager_hook(hook: _Fn) -> _Fn:
    """``hook`` (an ``eager_only`` bound method) as a module hook: where dynamo is loaded already (a
    block compiled before it is sharded, as torchtitan orders them), marked for dynamo itself, which
    then runs it outside a ``fullgraph`` compile of the module; dynamo cannot see through the lazy
    wrapper there, and refuses the whole graph."""
    if "torch._dynamo" not in sys.modules:
        return hook
    return torch.compiler.disable(hook, recursive=True)


class WeakPartial:
    """``partial(fn, *objects)`` that holds the objects weakly, for hooks kept by a tensor or an
    autograd node: the garbage collector cannot see through those, so a hook holding its unit would
    close an uncollectable cycle (unit -> flat parameter or its views -> hook -> unit) and a deleted
    model would never be freed. Once an object is gone the call does nothing."""

    def __init__(self, fn: Callable[..., Any], *objects: Any) -> None:
        self._fn = fn
        self._refs = tuple(weakref.ref(obj) for obj in objects)

    def __call__(self, *args: Any) -> Any:
        objects = [ref() for ref in self._refs]
        if any(obj is None for obj in objects):
            return None
        return self._fn(*objects, *args)


def current_graph_task() -> int:
    """The autograd graph task running now (-1 outside backward); a reentrant checkpoint's
    recomputation runs its backward as a nested task."""
    return current_graph_task_id()


def inside_backward() -> bool:
    """A root forward inside a backward is a recomputation (activation checkpointing around the
    root), not a new iteration."""
    return current_graph_task() != -1
