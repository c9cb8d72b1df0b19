"""``FullyShardedDataParallel``: the module users wrap their model in.

``__init__`` is a recipe of named construction steps that ends by giving the unit its ``UnitState``
(``_engine.unit_state``), which owns the runtime and whose hooks do the work of ``forward``; the public
methods are thin, and torch's attribute names read the state through properties. Everything here keeps torch FSDP1's names, argument order and defaults, so
a script written for torch's FSDP1 runs after swapping the import.
"""

import contextlib
from enum import Enum
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union, cast

import torch
from torch import nn
from torch.autograd.profiler import record_function

from .._engine import collectives as comm
from .._engine.common import TrainingState
from .._engine.flat_grad import CommHook
from .._engine.handle import FlatParamHandle
from .._engine.root_state import RootState
from .._engine.traversal import (
    FSDP_WRAPPED_MODULE,
    clean_fqn,
    fsdp_units,
    unit_name,
    unit_paths,
)
from .._engine.unit_state import UnitState, gradients_unsynchronised, state_of
from .._engine.unshard import summon_full_params
from .._state_dict import state_dict as _state_dict
from .._state_dict.settings import state_dicts_of
from ..api import (
    BackwardPrefetch,
    BlockQuantization,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictType,
    check_comm_quantization,
    coerce_config,
    coerce_enum,
)
from ..comm_hooks import is_low_precision_hook
from ..wrap import AutoWrapPolicy
from . import clip_grad as _clip_grad
from .initial_values import check_param_init_fn, check_same_values
from .mixed_precision_argument import checked_precision
from .optim_state_dict_api import OptimStateDictAPI, OptimStateKeyType
from .process_groups import (
    HYBRID_STRATEGIES,
    SHARDED_STRATEGIES,
    coerce_sharding_strategy,
    node_local_groups,
    resolve_process_groups,
    resolve_sharding_strategy,
    unit_schedule,
)
from .unit_handle import UnitHandleBuilder
from .unit_plan import auto_wrap, refuse_fully_shard_modules, resolve_ignored_states

__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]


class FullyShardedDataParallel(nn.Module, OptimStateDictAPI):
    """Shards a module's parameters, gradients and optimizer state over the ranks of a process group.

    Each unit flattens the parameters of its module (minus those of nested units) into one
    ``FlatParameter`` and keeps one shard of it per rank. Forward and backward all-gather the unit's
    parameters around its computation; gradients are averaged over the ranks, as DDP's, and each
    rank keeps the shard it owns.
    """

    _is_fsdp_unit = True

    def __init__(
        self,
        module: nn.Module,
        process_group: Optional[Union[comm.ProcessGroup, Tuple[comm.ProcessGroup, comm.ProcessGroup]]] = None,
        sharding_strategy: Optional[ShardingStrategy] = None,
        cpu_offload: Optional[CPUOffload] = None,
        auto_wrap_policy: Optional[AutoWrapPolicy] = None,
        backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: Optional[MixedPrecision] = None,
        ignored_modules: Optional[Iterable[nn.Module]] = None,
        param_init_fn: Optional[Callable[[nn.Module], None]] = None,
        device_id: Optional[Union[int, torch.device]] = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Optional[Iterable[Any]] = None,
        device_mesh: Optional[Any] = None,
        *,
        comm_quantization: Optional[BlockQuantization] = None,
        _params_of_outer_units: Optional[Iterable[nn.Parameter]] = None,
    ) -> None:
        super().__init__()
        # Check everything before touching the module.
        refuse_fully_shard_modules(module)
        check_comm_quantization(comm_quantization, "FullyShardedDataParallel")
        if mixed_precision is not None:
            mixed_precision = checked_precision(coerce_config(mixed_precision, MixedPrecision, "mixed_precision"))
        check_param_init_fn(param_init_fn)
        strategy = coerce_sharding_strategy(sharding_strategy)
        if strategy in HYBRID_STRATEGIES and process_group is None and device_mesh is None and comm.is_initialized():
            process_group = node_local_groups()  # made once; the units auto-wrapping builds share them
        groups = resolve_process_groups(process_group, device_mesh, strategy)
        self.rank = comm.group_rank(groups.shard)
        self.world_size = comm.group_size(groups.shard)
        strategy = resolve_sharding_strategy(strategy, groups)
        self._ignored = resolve_ignored_states(module, ignored_modules, ignored_states)
        self.cpu_offload = CPUOffload() if cpu_offload is None else coerce_config(cpu_offload, CPUOffload, "cpu_offload")
        prefetch = None if backward_prefetch is None else coerce_enum(backward_prefetch, BackwardPrefetch, "backward_prefetch")
        self.limit_all_gathers = limit_all_gathers

        if not sync_module_states and _params_of_outer_units is None:  # the call the user made
            check_same_values(module, self._ignored, groups)

        # Children first: each planned submodule becomes its own unit with the same arguments (and
        # the parameters it must leave to an outer unit).
        if auto_wrap_policy is not None:
            child_kwargs = dict(
                process_group=process_group, sharding_strategy=sharding_strategy, cpu_offload=cpu_offload,
                mixed_precision=mixed_precision, backward_prefetch=backward_prefetch, device_id=device_id,
                forward_prefetch=forward_prefetch, limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params,
                param_init_fn=param_init_fn, sync_module_states=sync_module_states,
                ignored_states=self._ignored.params or None, device_mesh=device_mesh, comm_quantization=comm_quantization,
            )
            auto_wrap(module, auto_wrap_policy, child_kwargs, type(self), self._ignored)

        handle, compute_device = UnitHandleBuilder(module, self._ignored, param_init_fn, device_id).build(
            groups, strategy in SHARDED_STRATEGIES and self.world_size > 1, mixed_precision, use_orig_params,
            self.cpu_offload.offload_params, sync_module_states, _params_of_outer_units or (), comm_quantization)
        self._fsdp_wrapped_module = module

        # Runtime state, owned by the unit's state; the root is decided lazily, at the first forward.
        self._sharding_strategy = strategy
        UnitState(self, module, handle, groups.shard, unit_schedule(strategy, prefetch, forward_prefetch), mixed_precision,
                  compute_device, self._ignored.modules)
        for unit, path in unit_paths(self).items():
            if unit is not self:
                state_of(unit).nest(path)

        # State dicts: FULL by default, as torch's. NO_SHARD units save and load FULL whatever the
        # setting (torch's rule), except on a one-rank group, where SHARDED / LOCAL still give DTensors
        # that load on any number of ranks (torch's gives full tensors there, pytorch#109666).
        _state_dict.register_hooks(self, saves_full_only=strategy is ShardingStrategy.NO_SHARD and self.world_size > 1)

    # ------------------------------------------------------------------------------ the unit's state
    # torch's attribute names, which clients and torch's own tests read; the ``UnitState`` owns them.
    @property
    def _handle(self) -> Optional[FlatParamHandle]:
        return state_of(self).handle

    @property
    def training_state(self) -> TrainingState:
        return state_of(self).training_state

    @training_state.setter
    def training_state(self, value: TrainingState) -> None:
        state_of(self).training_state = value

    @property
    def _is_root(self) -> Optional[bool]:
        return state_of(self).is_root

    @property
    def _root_state(self) -> Optional[RootState[UnitState]]:
        state = state_of(self)
        return state.root_state if state.has_root_state else None

    @property
    def _sync_gradients(self) -> bool:
        return state_of(self).sync_gradients

    @property
    def process_group(self) -> comm.ProcessGroup:
        return state_of(self).process_group

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._sharding_strategy

    @property
    def mixed_precision(self) -> Optional[MixedPrecision]:
        return state_of(self).mixed_precision

    # torch's names for the state-dict settings, which torch's own tests read; ``UnitStateDicts`` owns them.
    @property
    def _state_dict_type(self) -> StateDictType:
        return state_dicts_of(self).type

    @property
    def _state_dict_config(self) -> StateDictConfig:
        return state_dicts_of(self).config

    @property
    def _optim_state_dict_config(self) -> OptimStateDictConfig:
        return state_dicts_of(self).optim_config

    @property
    def compute_device(self) -> torch.device:
        return state_of(self).compute_device

    @property
    def backward_prefetch(self) -> Optional[BackwardPrefetch]:
        return state_of(self).schedule.backward_prefetch

    @backward_prefetch.setter
    def backward_prefetch(self, value: Optional[BackwardPrefetch]) -> None:
        state_of(self).schedule.backward_prefetch = None if value is None else coerce_enum(value, BackwardPrefetch, "backward_prefetch")

    @property
    def forward_prefetch(self) -> bool:
        return state_of(self).schedule.forward_prefetch

    @forward_prefetch.setter
    def forward_prefetch(self, value: bool) -> None:
        state_of(self).schedule.forward_prefetch = value

    # ------------------------------------------------------------------------------ module protocol
    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == FSDP_WRAPPED_MODULE:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the wrapped module, whose forward hooks gather and reshard this unit (so a direct
        call of the wrapped module, as ``generate()`` makes, works the same)."""
        if torch.compiler.is_compiling():
            # Dynamo cannot resume after a graph break inside ``try`` and would compile nothing; a
            # compiled forward that raises is undone by the root's next forward instead.
            return self._run_forward(args, kwargs)
        try:
            return self._run_forward(args, kwargs)
        except BaseException:
            state_of(self).abort_forward()
            raise

    def _run_forward(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        with record_function("FullyShardedDataParallel.forward"):
            return self._fsdp_wrapped_module(*args, **kwargs)

    def apply(self, fn: Callable[[nn.Module], None]) -> "FullyShardedDataParallel":
        """``nn.Module.apply`` with this unit's parameters gathered, so that ``fn`` sees their full
        shapes (``xavier_uniform_`` needs them) and what it writes is what trains; nested units gather
        their own as ``apply`` reaches them, so only one unit is unsharded at a time. Refused with
        torch's ``ValueError`` unless this unit is idle."""
        self._assert_state(TrainingState.IDLE, "apply() gathers the parameters itself; call it outside "
                           "summon_full_params(), forward and backward")
        with summon_full_params(self, recurse=False, writeback=True):
            return super().apply(fn)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "FullyShardedDataParallel":
        """``.to()``, ``.double()``, ``.half()`` and friends convert the flat parameter, and the handle
        rebuilds every buffer and view from it, so that all of them keep one dtype and device."""
        state_of(self).convert(lambda: super(FullyShardedDataParallel, self)._apply(fn, recurse))
        return self

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[Tuple[str, nn.Parameter]]:
        """``nn.Module.named_parameters``; inside ``summon_full_params`` under the unwrapped model's
        names (as torch's), so that ``{n: p.clone() for n, p in model.named_parameters()}`` there is
        a plain state dict."""
        return self._clean_while_summoned(super().named_parameters(*args, **kwargs))

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[Tuple[str, torch.Tensor]]:
        """``nn.Module.named_buffers``; clean names inside ``summon_full_params``, as ``named_parameters``."""
        return self._clean_while_summoned(super().named_buffers(*args, **kwargs))

    def _clean_while_summoned(self, named: Iterator[Tuple[str, Any]]) -> Iterator[Tuple[str, Any]]:
        if self.training_state is not TrainingState.SUMMON_FULL_PARAMS:
            return named
        return ((clean_fqn(name), value) for name, value in named)

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:  # type: ignore[override]  # nn.Module's arguments, passed on
        """``nn.Module.state_dict`` in the form ``state_dict_type`` set (FULL by default), under the
        unwrapped model's names. Collective: every rank must call it."""
        if FSDP_WRAPPED_MODULE not in kwargs.get("prefix", "").split("."):  # not a nested unit's part of a call
            comm.check_every_rank_calls(self.process_group, "state_dict()")
        with _state_dict.saving(self):
            return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict`` of the form ``state_dict_type`` set, by clean names. The whole
        dict is checked first (shapes; with ``strict`` missing and unexpected keys), so a load that
        fails raises on every rank and changes nothing. Collective: every rank must call it."""
        with _state_dict.loading(self, strict):
            return super().load_state_dict(state_dict, strict, assign)

    # ------------------------------------------------------------------------------ torch FSDP1 surface
    @property
    def _has_params(self) -> bool:
        return self._handle is not None

    @property
    def _flat_param(self) -> Optional[nn.Parameter]:
        return self._handle.flat_param if self._handle is not None else None

    @property
    def params(self) -> List[nn.Parameter]:
        return [self._handle.flat_param] if self._handle is not None else []

    def check_is_root(self) -> bool:
        state_of(self).lazy_init()
        return bool(self._is_root)

    def _assert_state(self, state: Union[Enum, Sequence[Enum]], fix: str = "") -> None:
        """torch's check, which its test helpers call after every step, that this unit is in ``state``
        (or in one of a list). Members of fsdp1's ``TrainingState`` and of torch's are accepted alike,
        by name. Raises ``ValueError``, as torch's does, naming the unit and its state."""
        expected = [state] if isinstance(state, Enum) else list(state)
        if self.training_state.name in [s.name for s in expected]:
            return
        path = state_of(self).path
        where = "this unit" if path is None else unit_name(path)
        raise ValueError(
            f"fsdp1: {where} expected to be in states {[s.name for s in expected]} but current state is "
            f"{self.training_state.name}" + (f"; {fix}." if fix else ".")
        )

    summon_full_params = staticmethod(summon_full_params)
    set_state_dict_type = staticmethod(_state_dict.set_state_dict_type)
    get_state_dict_type = staticmethod(_state_dict.get_state_dict_type)
    state_dict_type = staticmethod(_state_dict.state_dict_type)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> List["FullyShardedDataParallel"]:
        """Every FSDP unit in ``module``'s tree, ``module`` included; only the outermost with ``root_only``.
        Only ``FullyShardedDataParallel`` units, as torch's: torch's DCP helpers take a model with
        none for a ``fully_shard`` model (they find its DTensors themselves)."""
        return [unit for unit in fsdp_units(module, root_only) if isinstance(unit, FullyShardedDataParallel)]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Scale every gradient so that their total ``norm_type``-norm, over all ranks and units, is at
        most ``max_norm``, as DDP plus ``torch.nn.utils.clip_grad_norm_`` would; returns the norm
        before scaling. Call it on the root, after backward, before the optimizer step.
        ``error_if_nonfinite`` (not in torch's FSDP1): a NaN or infinite norm raises on every rank
        before any gradient is scaled."""
        state = state_of(self)
        if not state.is_outermost():
            raise RuntimeError(
                f"fsdp1: clip_grad_norm_() should only be called on the root FSDP instance, but was called on "
                f"the inner FSDP unit '{state.path}'; call it on the model you run forward on, "
                "which sees every unit's gradients."
            )
        root_state = state.root_state
        if any(unit.training_state is not TrainingState.IDLE for unit in root_state.units):
            raise RuntimeError("fsdp1: clip_grad_norm_() was called during forward or backward; call it after backward().")
        for unit in root_state.units:
            if unit.handle is not None:
                unit.handle.grad.take_user_changes()  # a zero_grad() on the original parameters counts
        return _clip_grad.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite, self.cpu_offload.offload_params)

    def register_comm_hook(self, state: object, hook: Callable[..., object]) -> None:
        """Reduce every unit's gradient with ``hook`` instead of fsdp1's own reduction, with torch's
        contract: ``hook(state, grad, output)`` for sharded units, ``hook(state, grad)`` for the
        others (``fsdp1.comm_hooks`` has the default and compressing hooks). Call it once, on the
        root, before the first forward."""
        if not callable(hook):
            raise ValueError(f"fsdp1: register_comm_hook needs a callable hook, got {type(hook).__name__}.")
        this = state_of(self)
        if not this.is_outermost():
            raise AssertionError(
                f"register_comm_hook can only be called on a root instance; '{this.path}' "
                "is an inner unit. Call it on the model you run forward on."
            )
        units = this.root_state.units
        for unit in units:
            strategy = cast(FullyShardedDataParallel, unit.owner).sharding_strategy
            if strategy in HYBRID_STRATEGIES:
                raise AssertionError(
                    f"fsdp1: communication hooks are not supported for hybrid strategies (unit "
                    f"'{unit.path}' uses {strategy}), as in torch's FSDP1."
                )
            if unit.handle is not None and unit.handle.grad.settings.comm_hook is not None:
                raise AssertionError("A communication hook is already registered; register one hook, once, before training.")
            if unit.handle is not None and unit.handle.transport.grad_codec is not None:
                raise ValueError(
                    f"fsdp1: register_comm_hook replaces the gradient reduction that comm_quantization quantizes (unit "
                    f"'{unit.path or '<root>'}'): use one of them (BlockQuantization(gradients=None) leaves the reduction to the hook)."
                )
        comm_hook = CommHook(hook, state, is_low_precision_hook(hook))
        for unit in units:
            if unit.handle is not None:
                unit.handle.grad.settings.comm_hook = comm_hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, like DDP's ``no_sync``.

        The first backward after the context reduces the accumulated sum. Unsharded gradients are
        kept meanwhile, so memory grows by one unsharded gradient per unit.
        """
        state = state_of(self)
        if not state.is_outermost():
            raise RuntimeError(
                f"fsdp1: no_sync() was called on the inner FSDP unit '{state.path}'; it is only supported on "
                "the root unit. Call it on the model you run forward on: `with model.no_sync(): ...`."
            )
        with gradients_unsynchronised(state.root_state.units):
            yield
