"""Every private name of torch's that fsdp1 reaches, in one place, so that a new torch release is
checked here first and nowhere else. Each entry says what fsdp1 needs it for, the form it has, and
the public alternative where one exists (and why it is not enough). The forms are those of torch
2.13.0, 2.14.1 and 2.15.0, the releases the suite runs on; ``tests/test_torch_internals.py`` resolves
every path of ``PATHS`` on the release it runs under, and checks that no other module of fsdp1
imports or reads torch privately.

Two kinds of name stay outside, each for a reason the test spells out: nn.Module's own registries
(``_parameters``, ``_buffers``, ``_modules``), which every model library reads and writes and which
the step's hot paths read as plain attributes; and an override of a torch method calling torch's own
(``super()._apply``, ``super()._unscale_grads_``). The names of torch's modules and bindings that
fsdp1 replaces (its FSDP classes under ``use_as_torch_fsdp()``, the helpers' class tests) are tables
of their own: ``_torch_alias.py`` and ``_torch_recognition.py``."""

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Sequence, Type, TypeVar

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed import ProcessGroup
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem, _get_registry
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves, tree_map

if TYPE_CHECKING:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = ["TorchDispatchMode", "is_traceable_wrapper_subclass", "tree_leaves", "tree_map"]  # re-exported as they are

PATHS = (
    "torch.distributed._composable.contract.REGISTRY_KEY",
    "torch.distributed._composable.contract.RegistryItem",
    "torch.distributed._composable.contract._get_registry",
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    "torch.distributed.device_mesh.DeviceMesh._concatenate",
    "torch.distributed.device_mesh.DeviceMesh._flatten",
    "torch.nn.modules.batchnorm._BatchNorm",
    "torch.nn.modules.batchnorm._NormBase",
    "torch.nn.Module._register_state_dict_hook",
    "torch.nn.Module._load_from_state_dict",
    "torch.utils._python_dispatch.TorchDispatchMode",
    "torch.utils._python_dispatch.is_traceable_wrapper_subclass",
    "torch.utils._pytree.tree_leaves",
    "torch.utils._pytree.tree_map",
    "torch.Tensor._make_wrapper_subclass",
    "torch._C.DisableTorchFunctionSubclass",
    "torch._C._current_graph_task_id",
    "torch.autograd.Variable._execution_engine",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
    "torch.ops.aten._scaled_dot_product_efficient_attention",
    "torch.ops.aten._grouped_mm",
    "torch.testing._internal.distributed.fake_pg.FakeStore",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointImpl",
    "torch.distributed.algorithms._comm_hooks.LOW_PRECISION_HOOKS",
    "torch.distributed.pipelining.schedules._PipelineScheduleRuntime",
    "torch.distributed.ProcessGroup._get_backend",
)
"""The private paths below, each resolved by the test on the running release (attributes of
instances, such as a DTensor's ``_local_tensor`` or a GradScaler's ``_scale``, are exercised by the
suite instead)."""

MODULE_REGISTRIES = ("_parameters", "_buffers", "_modules")
"""nn.Module's own registries, read and written in place as plain attributes: every model library
does, torch has kept them since its first release, and the step's hot paths read them per module."""

_T = TypeVar("_T", bound=torch.Tensor)

# ------------------------------------------------------------------------------------ names as torch has them
StridedShard = _StridedShard
"""The placement of FSDP's shard dim over a dim tensor parallelism already shards (``split_factor``
TP shards per FSDP row block), which torch's ``fully_shard`` gives such parameters and DCP reads;
since torch 2.5. No public alternative: a plain ``Shard`` would reorder the rows."""

BatchNormBase = _BatchNorm
"""torch FSDP1's default ``MixedPrecision._module_classes_to_ignore``; public alternative: none (the
three BatchNorm classes would miss torch's and users' subclasses of the base)."""

NormBase = _NormBase
"""The base of BatchNorm and InstanceNorm, whose running statistics may be absent from a state dict;
public alternative: none."""

# ``TorchDispatchMode``, ``is_traceable_wrapper_subclass``: the planner's dry run and memory tracker
# dispatch below autograd, and tensor subclasses are told apart, as torch's own subclasses are
# (documented in torch's "extending" notes, in a private module); ``tree_leaves``, ``tree_map``: the
# dispatch arguments' tensors (torch has no public pytree module in these releases).


# ------------------------------------------------------------------------------------------- composable API
def composable_apis_of(module: nn.Module) -> Dict[str, Any]:
    """The composable APIs applied to ``module`` (``fully_shard``, ``replicate``): torch's registry,
    which its ``replicate`` reads to leave ``fully_shard``'s parameters out. Public alternative: none."""
    return _get_registry(module) or {}


def register_composable_api(module: nn.Module, name: str) -> None:
    """Enter ``module`` under ``name`` in that registry, as torch's composable APIs do on application."""
    module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())[name] = RegistryItem()


# ------------------------------------------------------------------------------------------ DTensor internals
def local_tensor(dtensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor itself, with no autograd node: public ``to_local()`` records one and
    makes a view each call, on every parameter every step."""
    return dtensor._local_tensor  # type: ignore[attr-defined]  # a DTensor's slot


def spec_of(dtensor: torch.Tensor) -> "DTensorSpec":
    """A DTensor's mesh, placements and global shape in one object, which building a DTensor directly
    (without ``from_local``'s autograd function and new spec each call) takes."""
    return dtensor._spec  # type: ignore[attr-defined]  # a DTensor's slot


def rebind(dtensor: torch.Tensor, local: torch.Tensor, spec: "DTensorSpec") -> None:
    """Make ``dtensor`` (a parameter whose identity the optimizer holds) show ``local`` under
    ``spec``, in place. Public alternative: none (``set_`` works on plain tensors only)."""
    dtensor._local_tensor = local  # type: ignore[attr-defined]  # a DTensor's slot
    dtensor._spec = spec  # type: ignore[attr-defined]  # a DTensor's slot


def dtensor(local: torch.Tensor, spec: "DTensorSpec", requires_grad: bool = False) -> DTensor:
    """A DTensor built on ``local`` with ``spec`` by DTensor's own constructor, which torch documents
    as private (``from_local`` is the public one, at the cost said above)."""
    return DTensor(local, spec, requires_grad=requires_grad)


def storage_key(storage: torch.UntypedStorage) -> int:
    """The address of a storage's C++ object, the same for every tensor on it while it lives: what
    the planner's tracker counts storages by. Public alternative: ``data_ptr()``, which two empty
    storages share."""
    return storage._cdata


# ------------------------------------------------------------------------------------------------ device mesh
def concatenate_meshes(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """One mesh of ``meshes``' dims (the data-parallel mesh beside a tensor-parallel one), as torch's
    ``fully_shard`` builds it over a TP DTensor. Public alternative: none (a new ``init_device_mesh``
    would make new process groups)."""
    return DeviceMesh._concatenate(list(meshes))


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """Several dims of ``mesh`` as one, over one process group, as FSDP2 shards over
    ``("dp_replicate", "dp_shard")``. Public alternative: none."""
    return mesh._flatten(name)


# ------------------------------------------------------------------------------------------------- autograd
def current_graph_task_id() -> int:
    """The autograd graph task running now, -1 outside backward. Public alternative: none."""
    return torch._C._current_graph_task_id()


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward has finished (a unit's final reductions), as torch's
    FSDP and DDP do. Public alternative: none (a hook on the first layer misses unused parameters)."""
    Variable._execution_engine.queue_callback(callback)


def version_of(tensor: torch.Tensor) -> int:
    """The tensor's version counter, which in-place changes bump: a gathered copy is current while it
    is unchanged. Public alternative: none."""
    return tensor._version


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` views another (keeps its base alive). Public alternative: none."""
    return tensor._base is not None


def view_base(tensor: torch.Tensor) -> Any:
    """The tensor ``tensor`` views, or None. Public alternative: none."""
    return tensor._base


def post_accumulate_grad_hooks(tensor: torch.Tensor) -> Iterator[Callable[[torch.Tensor], None]]:
    """The hooks ``register_post_accumulate_grad_hook`` put on ``tensor``, to run them where fsdp1
    puts the reduced gradient itself (optimizer-in-backward). Public alternative: none."""
    return iter((getattr(tensor, "_post_accumulate_grad_hooks", None) or {}).values())


def forget_post_accumulate_grad_hooks(tensor: torch.Tensor) -> None:
    """Set ``tensor``'s post-accumulate-grad hooks back to torch's own "none yet" (a swapped tensor
    keeps the dict of the one it was swapped with)."""
    tensor._post_accumulate_grad_hooks = None  # type: ignore[assignment]  # torch's own "no hooks yet"


def wrapper_subclass(cls: Type[_T], shape: torch.Size, like: torch.Tensor) -> _T:
    """A tensor of class ``cls`` with ``like``'s dtype and device and no storage (a placeholder that
    explains itself when used). Public alternative: none."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=like.dtype, device=like.device)


def torch_function_subclass_disabled() -> Any:
    """A context in which a subclass's ``__torch_function__`` is off (its metadata reads). Public
    alternative: none."""
    return torch._C.DisableTorchFunctionSubclass()


# ------------------------------------------------------------------------------------------ process groups
def group_timeout(group: ProcessGroup) -> Any:
    """The group's own timeout (``init_process_group(timeout=...)``), which torch keeps on the
    backend's options; ``None`` where the backend has none. Public alternative: none."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


# ---------------------------------------------------------------------------------------------- nn.Module
def register_state_dict_hook(module: nn.Module, post_state_dict: Callable[..., Any]) -> None:
    """The state-dict post-hook torch's FSDP1 registers, which may return a new dict; the public
    ``register_state_dict_post_hook`` must change the dict in place."""
    module._register_state_dict_hook(post_state_dict)


def has_load_state_dict_pre_hooks(module: nn.Module) -> bool:
    return bool(module._load_state_dict_pre_hooks)


def is_persistent_buffer(module: nn.Module, name: str) -> bool:
    """Whether the buffer ``name`` goes into the state dict. Public alternative: none short of
    building the state dict."""
    return name not in module._non_persistent_buffers_set


def loads_state_dict_its_own_way(module: nn.Module) -> bool:
    """Whether ``module``'s class overrides how it loads (and may rename keys), or it has load hooks."""
    return type(module)._load_from_state_dict is not nn.Module._load_from_state_dict or has_load_state_dict_pre_hooks(module)


def is_checkpoint_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is torch's ``checkpoint_wrapper`` (which only renames keys)."""
    return hasattr(module, "_checkpoint_wrapped_module")


# ------------------------------------------------------------------------------------- torch's other modules
def fake_store() -> Any:
    """A store for the ``"fake"`` backend, whose collectives move nothing, which importing it
    registers (the planner's dry run). Public alternative: none (testing code of torch's)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def checkpoint_wrapper_api() -> Any:
    """torch's ``checkpoint_wrapper`` module (``checkpoint_wrapper``, ``CheckpointImpl``), whose wrapper
    torch FSDP1 users checkpoint blocks with and whose keys their checkpoints hold (its
    ``apply_activation_checkpointing`` imports torch's FSDP1, so fsdp1 does not call it);
    ``torch.utils.checkpoint`` is the public one, with no module wrapper."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper

    return checkpoint_wrapper


def torch_low_precision_hooks() -> Sequence[Callable[..., Any]]:
    """torch's FSDP1 low-precision communication hooks, which scripts written for it register."""
    try:
        from torch.distributed.algorithms._comm_hooks import LOW_PRECISION_HOOKS
    except ImportError:
        return ()
    return LOW_PRECISION_HOOKS


def flash_attention_for_cpu(*args: Any, **kwargs: Any) -> Any:
    """aten's flash-attention kernel for CPUs, which takes fewer key and value heads as they are;
    ``scaled_dot_product_attention`` chooses it itself only where it supports the inputs."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, **kwargs)


def efficient_attention(*args: Any, **kwargs: Any) -> Any:
    """aten's memory-efficient attention kernel, forced where ``scaled_dot_product_attention`` would
    choose (the planner's estimate of the kernel a GPU run takes)."""
    return torch.ops.aten._scaled_dot_product_efficient_attention(*args, **kwargs)


def is_grouped_mm(func: Any) -> bool:
    """Whether ``func`` is aten's grouped matmul (Transformers' mixture-of-experts layers), whose meta
    kernel refuses float32 inputs that its CPU kernel takes."""
    return func is torch.ops.aten._grouped_mm.default


def op_schema(func: Any) -> Any:
    """An aten operation's schema (which arguments it writes, what it returns). Public alternative:
    none for an ``OpOverload``."""
    return func._schema


def runtime_schedule_class() -> type:
    """The class of torch's pipeline schedules that run an action list (the split-backward ones)."""
    from torch.distributed.pipelining import schedules

    return schedules._PipelineScheduleRuntime


def schedule_stages(schedule: Any) -> Sequence[Any]:
    """A pipeline schedule's stages on this rank. Public alternative: none."""
    return schedule._stages


def schedule_has_backward(schedule: Any) -> bool:
    """Whether the schedule runs a backward (not built for ``eval()``)."""
    return bool(getattr(schedule, "_has_backward", True))


def found_inf_flags(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> Dict[torch.device, torch.Tensor]:
    """The inf/NaN flags ``GradScaler.unscale_`` left for ``optimizer``, one per device, which a
    sharded scaler sums over the ranks before ``step``. Public alternative: none."""
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]


def scale_tensor(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """The scaler's scale as a tensor (``get_scale()`` returns a float, which syncs)."""
    assert scaler._scale is not None, "GradScaler's unscale_ refuses to run before scale() made it"
    return scaler._scale
