"""``GroupForward``: the forward hooks of a unit made of several modules (``fully_shard([a, b])``)."""

from typing import Any, Dict, Optional, Protocol, Sequence, Set, Tuple

from torch import nn

from .common import TrainingState


class ForwardHooks(Protocol):
    """What a group's hooks call of its unit's state (``UnitState``)."""

    training_state: TrainingState

    def pre_forward(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                    ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]: ...

    def post_forward(self, module: nn.Module, args: Tuple[Any, ...], output: Any) -> Any: ...

    def cast_inputs(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]: ...

    def cast_output(self, output: Any) -> Any: ...


class GroupForward:
    """The forward hooks of a unit made of several modules: its forward begins when the first of them
    runs and ends once each has run, as torch's FSDP2 groups them (one gather, one set of views, so
    that backward accumulates the unit's gradient once). Every module's floating-point inputs are
    cast (``cast_forward_inputs``) and its outputs too (``output_dtype``). A forward in which some
    module did not run (the model's forward skipped the loss head, which runs per chunk after it)
    ends with the root's forward (``finish``); a module called on its own after that begins a forward
    of the group that the end of its backward closes (``clear``)."""

    def __init__(self, state: ForwardHooks, modules: Sequence[nn.Module]) -> None:
        self._state = state
        self._modules = modules
        self._to_run: Set[int] = set()
        for module in modules:
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward)

    @property
    def is_incomplete(self) -> bool:
        return bool(self._to_run)

    def clear(self) -> None:
        self._to_run.clear()

    def finish(self, output: Any) -> Any:
        """End a forward some module of the group did not run in, on ``output`` (the root's)."""
        self._to_run.clear()
        return self._state.post_forward(self._modules[0], (), output)

    def _pre_forward(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                     ) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
        if self._to_run and self._state.training_state is not TrainingState.IDLE:
            return self._state.cast_inputs(args, kwargs)
        self._to_run = {id(m) for m in self._modules}
        return self._state.pre_forward(module, args, kwargs)

    def _post_forward(self, module: nn.Module, args: Tuple[Any, ...], output: Any) -> Any:
        if id(module) in self._to_run:
            self._to_run.discard(id(module))
            if not self._to_run:
                return self._state.post_forward(module, args, output)
        return self._state.cast_output(output)
