"""``FullyShardedDataParallel``: the module users wrap their model in.

``__init__`` is a recipe of named construction steps; ``forward`` hands over to ``_runtime``; the
public methods are thin. Everything here keeps torch FSDP1's names, argument order and defaults, so
a script written for torch's FSDP1 runs after swapping the import.
"""

import contextlib
from enum import Enum, auto
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn
from torch.autograd.profiler import record_function

from . import _clip_grad, _init, _optim_state_dict, _runtime, _state_dict, comm_hooks
from . import _collectives as comm
from ._common import HYBRID_STRATEGIES, SHARDED_STRATEGIES, TrainingState
from ._device import materialization_device, resolve_compute_device
from ._flat_param import CommHook, FlatParameter, FlatParamHandle
from ._mixed_precision import HandlePrecision, checked_precision
from ._traversal import FSDP_WRAPPED_MODULE, ParamSlot, clean_fqn, fsdp_units, unit_name, unit_paths
from ._unshard import summon_full_params
from .api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictType,
    coerce_config,
    coerce_enum,
)
from .wrap import AutoWrapPolicy

__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]


class OptimStateKeyType(Enum):
    """How ``rekey_optim_state_dict`` keys optimizer state: by parameter name or by position."""

    PARAM_NAME = auto()
    PARAM_ID = auto()


class FullyShardedDataParallel(nn.Module):
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
        process_group: Optional[comm.ProcessGroup] = None,
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
        _params_of_outer_units: Optional[Iterable[nn.Parameter]] = None,
    ) -> None:
        super().__init__()
        # Check everything before touching the module.
        if mixed_precision is not None:
            mixed_precision = checked_precision(coerce_config(mixed_precision, MixedPrecision, "mixed_precision"))
        _init.check_param_init_fn(param_init_fn)
        strategy = _init.coerce_sharding_strategy(sharding_strategy)
        if strategy in HYBRID_STRATEGIES and process_group is None and device_mesh is None and comm.is_initialized():
            process_group = _init.node_local_groups()  # made once; the units auto-wrapping builds share them
        groups = _init.resolve_process_groups(process_group, device_mesh, strategy)
        self.process_group = groups.shard
        self.rank = comm.group_rank(self.process_group)
        self.world_size = comm.group_size(self.process_group)
        self.sharding_strategy = _init.resolve_sharding_strategy(strategy, groups)
        self._ignored = _init.resolve_ignored_states(module, ignored_modules, ignored_states)
        self.cpu_offload = CPUOffload() if cpu_offload is None else coerce_config(cpu_offload, CPUOffload, "cpu_offload")
        self.mixed_precision = mixed_precision
        self.backward_prefetch = (
            None if backward_prefetch is None else coerce_enum(backward_prefetch, BackwardPrefetch, "backward_prefetch")
        )
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers

        if not sync_module_states and _params_of_outer_units is None:  # the call the user made
            _init.check_same_values(module, self._ignored, groups)

        # Children first: each planned submodule becomes its own unit with the same arguments (and
        # the parameters it must leave to an outer unit).
        if auto_wrap_policy is not None:
            child_kwargs = dict(
                process_group=process_group,
                sharding_strategy=sharding_strategy,
                cpu_offload=cpu_offload,
                mixed_precision=mixed_precision,
                backward_prefetch=backward_prefetch,
                device_id=device_id,
                forward_prefetch=forward_prefetch,
                limit_all_gathers=limit_all_gathers,
                use_orig_params=use_orig_params,
                param_init_fn=param_init_fn,
                sync_module_states=sync_module_states,
                ignored_states=self._ignored.params or None,
                device_mesh=device_mesh,
            )
            _init.auto_wrap(module, auto_wrap_policy, child_kwargs, type(self), self._ignored)

        # This unit materialises and synchronises what the children left, then flattens it on the
        # compute device. Meta parameters reset by the default init get their storage in the flat
        # buffer itself, so their unit is never held twice.
        meta_init = _init.MetaInit(module, param_init_fn, materialization_device(device_id), self._ignored)
        if meta_init.is_needed and not meta_init.is_in_place:
            meta_init.run_param_init_fn()
        slots = _init.unit_param_slots(module, use_orig_params, self._ignored, _params_of_outer_units or ())

        def initialize(slots: Sequence[ParamSlot]) -> None:
            if meta_init.is_in_place:
                meta_init.reset_in_place()
            if sync_module_states:
                _init.sync_module_states(module, slots, self._ignored, groups)

        if meta_init.is_in_place:
            self.compute_device = meta_init.device
        else:
            self.compute_device = resolve_compute_device(module, device_id, self._ignored.params)
        if device_id is not None:
            _init.move_to_compute_device(module, self.compute_device, self._ignored)
        if not meta_init.is_in_place:
            initialize(slots)  # on the compute device: NCCL broadcasts no CPU tensor
        self._fsdp_wrapped_module = module
        self._handle: Optional[FlatParamHandle] = None
        if slots:
            is_sharded = self.sharding_strategy in SHARDED_STRATEGIES and self.world_size > 1
            self._handle = FlatParamHandle(
                slots, module, groups.shard, groups.replicate, is_sharded, use_orig_params,
                HandlePrecision.of(mixed_precision, slots[0].param.dtype), self.cpu_offload.offload_params,
                materialize_in_place=initialize if meta_init.is_in_place else None, device=self.compute_device,
            )
        elif meta_init.is_in_place:
            initialize(slots)
        for unit, path in unit_paths(self).items():
            if unit._handle is not None and unit is not self:
                unit._handle.set_path(path)

        # Runtime state; the root is decided lazily, at the first forward.
        _runtime.forget_roots(module)
        self.training_state = TrainingState.IDLE
        self._is_root: Optional[bool] = None
        self._root_state: Optional[_runtime.RootState] = None
        self._sync_gradients = True
        self._awaits_pre_backward = False  # an output of this forward will call _pre_backward
        self._backward_graph_task = -1  # autograd graph task this unit's backward began in
        self._awaits_reduction = False  # a nested backward accumulated a partial gradient
        self._has_post_backward_hook = False
        self._submodule_forward: Optional[nn.Module] = None  # a submodule called from outside, running
        _runtime.register_post_backward_hook(self)
        _runtime.register_forward_hooks(self)

        # State dicts: FULL by default, as torch's; the names are torch's, which clients read.
        self._state_dict_type = StateDictType.FULL_STATE_DICT
        self._state_dict_config: StateDictConfig = FullStateDictConfig()
        self._optim_state_dict_config: OptimStateDictConfig = FullOptimStateDictConfig()
        self._state_dict_mesh: Optional[comm.DeviceMesh] = None  # the shard group's, made at the first SHARDED save
        self._keys_loaded_by_hook: Set[str] = set()  # by the load pre-hook, for the post-hook's report
        self._load_is_strict: Optional[bool] = None  # known while a load called on a unit runs
        _state_dict.register_hooks(self)

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
            _runtime.abort_forward(self)
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
        if self._handle is None:
            return super()._apply(fn, recurse)
        with self._handle.flat_param_registered():
            result = super()._apply(fn, recurse)
        self._handle.adopt_converted_flat_param()
        self.compute_device = self._handle.compute_device  # with offloading the shard stays on the CPU
        return result

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

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
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
    def _flat_param(self) -> Optional[FlatParameter]:
        return self._handle.flat_param if self._handle is not None else None

    @property
    def params(self) -> List[FlatParameter]:
        return [self._handle.flat_param] if self._handle is not None else []

    def check_is_root(self) -> bool:
        _runtime.lazy_init(self)
        return bool(self._is_root)

    def _assert_state(self, state: Union[Enum, Sequence[Enum]], fix: str = "") -> None:
        """torch's check, which its test helpers call after every step, that this unit is in ``state``
        (or in one of a list). Members of fsdp1's ``TrainingState`` and of torch's are accepted alike,
        by name. Raises ``ValueError``, as torch's does, naming the unit and its state."""
        expected = [state] if isinstance(state, Enum) else list(state)
        if self.training_state.name in [s.name for s in expected]:
            return
        path = self._root_state.path_of(self) if self._root_state is not None else None
        where = "this unit" if path is None else unit_name(path)
        raise ValueError(
            f"fsdp1: {where} expected to be in states {[s.name for s in expected]} but current state is "
            f"{self.training_state.name}" + (f"; {fix}." if fix else ".")
        )

    summon_full_params = staticmethod(summon_full_params)
    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Optional[Dict[str, Any]] = None,
                         group: Optional[comm.ProcessGroup] = None) -> Dict[str, Any]:
        """The optimizer's state by clean parameter name, in the form ``state_dict_type`` set (FULL:
        full tensors; SHARDED: DTensor rows for DCP; LOCAL: as the optimizer keeps it). A fresh
        optimizer gets its state first, so the result is a complete template. Collective."""
        return _optim_state_dict.optim_state_dict(model, optim, optim_state_dict)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Dict[str, Any],
                                 is_named_optimizer: bool = False, load_directly: bool = False,
                                 group: Optional[comm.ProcessGroup] = None) -> Dict[str, Any]:
        """What ``optim.load_state_dict`` takes, from what ``optim_state_dict`` gave (on any world
        size, for SHARDED). Collective."""
        return _optim_state_dict.optim_state_dict_to_load(model, optim, optim_state_dict, load_directly)

    @staticmethod
    def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input: Any = None,
                              rank0_only: bool = True, group: Optional[comm.ProcessGroup] = None) -> Dict[str, Any]:
        """The older API: ``optim_state_dict`` under FULL (on rank 0 only, by default)."""
        return _optim_state_dict.full_optim_state_dict(model, optim, rank0_only)

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                                 group: Optional[comm.ProcessGroup] = None) -> Dict[str, Any]:
        """The older API: ``optim_state_dict`` under SHARDED."""
        return _optim_state_dict.sharded_optim_state_dict(model, optim)

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict: Dict[str, Any], model: nn.Module, optim_input: Any = None,
                                    optim: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
        """The older API: each rank's part of a FULL dict that every rank holds, for ``optim.load_state_dict``
        of ``optim`` (or, as torch's, of an optimizer built on ``model.parameters()``, or on ``optim_input``)."""
        return _optim_state_dict.shard_full_optim_state_dict(full_optim_state_dict, model, optim, optim_input)

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict: Dict[str, Any], model: nn.Module,
                                         optim: torch.optim.Optimizer) -> Dict[str, Any]:
        """The older API: ``optim_state_dict_to_load`` under SHARDED."""
        return _optim_state_dict.flatten_sharded_optim_state_dict(sharded_optim_state_dict, model, optim)

    @staticmethod
    def scatter_full_optim_state_dict(full_optim_state_dict: Optional[Dict[str, Any]], model: nn.Module,
                                      optim_input: Any = None, optim: Optional[torch.optim.Optimizer] = None,
                                      group: Optional[Any] = None) -> Dict[str, Any]:
        """The older API: rank 0 holds the FULL dict (the others pass None) and sends each rank its part
        (for ``optim``, or as ``shard_full_optim_state_dict`` without it)."""
        return _optim_state_dict.scatter_full_optim_state_dict(full_optim_state_dict, model, optim, optim_input)

    @staticmethod
    def rekey_optim_state_dict(optim_state_dict: Dict[str, Any], optim_state_key_type: "OptimStateKeyType",
                               model: nn.Module, optim_input: Any = None,
                               optim: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
        """The same state keyed by clean parameter name or by position (as a model without FSDP numbers
        its parameters), to move optimizer state between wrapped and unwrapped models."""
        by_name = coerce_enum(optim_state_key_type, OptimStateKeyType, "optim_state_key_type") is OptimStateKeyType.PARAM_NAME
        return _optim_state_dict.rekey_optim_state_dict(optim_state_dict, by_name, model, optim)

    set_state_dict_type = staticmethod(_state_dict.set_state_dict_type)
    get_state_dict_type = staticmethod(_state_dict.get_state_dict_type)
    state_dict_type = staticmethod(_state_dict.state_dict_type)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> List["FullyShardedDataParallel"]:
        """Every FSDP unit in ``module``'s tree, ``module`` included; only the outermost with ``root_only``."""
        return fsdp_units(module, root_only)  # type: ignore[return-value]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Scale every gradient so that their total ``norm_type``-norm, over all ranks and units, is at
        most ``max_norm``, as DDP plus ``torch.nn.utils.clip_grad_norm_`` would; returns the norm
        before scaling. Call it on the root, after backward, before the optimizer step.
        ``error_if_nonfinite`` (not in torch's FSDP1): a NaN or infinite norm raises on every rank
        before any gradient is scaled."""
        _runtime.lazy_init(self)
        if not self._is_root:
            raise RuntimeError(
                f"fsdp1: clip_grad_norm_() should only be called on the root FSDP instance, but was called on "
                f"the inner FSDP unit '{self._root_state.path_of(self)}'; call it on the model you run forward on, "
                "which sees every unit's gradients."
            )
        if any(unit.training_state is not TrainingState.IDLE for unit in self._root_state.units):
            raise RuntimeError("fsdp1: clip_grad_norm_() was called during forward or backward; call it after backward().")
        for unit in self._root_state.units:
            if unit._handle is not None:
                unit._handle.write_back_orig_grads()  # a zero_grad() on the original parameters counts
        return _clip_grad.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    def register_comm_hook(self, state: object, hook: Callable[..., object]) -> None:
        """Reduce every unit's gradient with ``hook`` instead of fsdp1's own reduction, with torch's
        contract: ``hook(state, grad, output)`` for sharded units, ``hook(state, grad)`` for the
        others (``fsdp1.comm_hooks`` has the default and compressing hooks). Call it once, on the
        root, before the first forward."""
        if not callable(hook):
            raise ValueError(f"fsdp1: register_comm_hook needs a callable hook, got {type(hook).__name__}.")
        _runtime.lazy_init(self)
        if not self._is_root:
            raise AssertionError(
                f"register_comm_hook can only be called on a root instance; '{self._root_state.path_of(self)}' "
                "is an inner unit. Call it on the model you run forward on."
            )
        units = self._root_state.units
        for unit in units:
            if unit.sharding_strategy in HYBRID_STRATEGIES:
                raise AssertionError(
                    f"fsdp1: communication hooks are not supported for hybrid strategies (unit "
                    f"'{self._root_state.path_of(unit)}' uses {unit.sharding_strategy}), as in torch's FSDP1."
                )
            if unit._handle is not None and unit._handle.has_comm_hook:
                raise AssertionError("A communication hook is already registered; register one hook, once, before training.")
        comm_hook = CommHook(hook, state, comm_hooks.is_low_precision_hook(hook))
        for unit in units:
            if unit._handle is not None:
                unit._handle.set_comm_hook(comm_hook)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, like DDP's ``no_sync``.

        The first backward after the context reduces the accumulated sum. Unsharded gradients are
        kept meanwhile, so memory grows by one unsharded gradient per unit.
        """
        _runtime.lazy_init(self)
        if not self._is_root:
            path = self._root_state.path_of(self)
            raise RuntimeError(
                f"fsdp1: no_sync() was called on the inner FSDP unit '{path}'; it is only supported on "
                "the root unit. Call it on the model you run forward on: `with model.no_sync(): ...`."
            )
        units = self._root_state.units
        previous = [unit._sync_gradients for unit in units]
        for unit in units:
            unit._sync_gradients = False
        try:
            yield
        finally:
            for unit, sync in zip(units, previous):
                unit._sync_gradients = sync
