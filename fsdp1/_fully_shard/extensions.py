"""All-gather extensions: a parameter whose local tensor defines ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` (torchao's float8 and int8 training weights, or hooks set on a local tensor
after ``fully_shard``) is gathered through them, with torch's FSDP2 signatures and call pattern.

Such a parameter's values live in its own local tensor (a tensor subclass the optimizer steps), not
in the unit's shard; its place in the shard only takes its gradient, which the unit reduces with the
others, so the gradient is reduced as torch's reduces it. ``ExtensionGather`` does the rest: the
pre-hook gives the tensors to gather, each is gathered over the shard group, and the post-hook makes
the unsharded tensor the module computes on (the first time; afterwards it refills it in place,
``out=``, from the same gathered buffers, whose storage is freed while the unit is resharded).
"""

import inspect
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from .._engine import collectives as comm
from .._engine.dtensors import contiguous_stride
from .._engine.flat_grad import plain_gradient
from .._engine.layout import alloc_storage, free_storage


@dataclass(frozen=True)
class GatherContext:
    """What the hooks are given besides the tensor: the mesh of the shard group, and the unit's
    mixed-precision policy (its ``param_dtype`` the dtype the post-hook makes)."""

    shard_mesh: Optional[comm.DeviceMesh]  # None: no shard dim (fully_shard refuses extensions there)
    mp_policy: Any
    param_dtype: Optional[torch.dtype]


def has_extension(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` defines an all-gather extension (both hooks, or torch's error)."""
    pre, post = hasattr(tensor, "fsdp_pre_all_gather"), hasattr(tensor, "fsdp_post_all_gather")
    if pre != post:
        raise AssertionError(  # torch's type and phrase
            f"Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined if using all-gather extensions: {tensor}"
        )
    return pre


class ExtensionGather:
    """One parameter's gathers through its extension: ``local`` its sharded local tensor, ``size``
    the unsharded (local, for a tensor-parallel parameter) size, ``module`` the module that holds it."""

    def __init__(self, local: torch.Tensor, size: torch.Size, shard_dim: int, module: nn.Module, context: GatherContext) -> None:
        self.local = local
        self._size, self._module, self._context = size, module, context
        assert context.shard_mesh is not None, "fully_shard refuses extensions without a shard dim"
        self._mesh = context.shard_mesh
        self._group = context.shard_mesh.get_group()
        padded = list(size)
        padded[shard_dim] = -(-size[shard_dim] // comm.group_size(self._group))
        self._padded_size = torch.Size(padded)  # what each rank's inputs must have: the first rank's chunk
        self._outputs: List[torch.Tensor] = []  # the gathered buffers, kept: the unsharded tensor may view them
        self._unsharded: Optional[torch.Tensor] = None
        self._inner: List[torch.Tensor] = []  # the tensors the post-hook said to free while resharded
        self._is_gathered = False
        self._made: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # (view, what the module computes on)
        self._metadata: Any = None  # the pre-hook's, for the post-hook
        self._input_kinds: List[Tuple[torch.dtype, torch.Size]] = []  # the pre-hook's tensors' dtypes and shapes

    def computing(self, view: torch.Tensor) -> torch.Tensor:
        """The unsharded tensor the module computes on, gathered if it is not; ``view`` (the
        parameter's place in the gathered buffer) takes its gradient."""
        assert self._is_gathered, "the unit's gather for computing carries every extension's tensors"
        if self._made is not None and self._made[0] is view:
            return self._made[1]
        assert self._unsharded is not None, "gathered just above"
        made = _GradientToView.apply(view, self._unsharded)
        if not view.is_leaf:  # a forward's view of the flat parameter: a recomputation in backward gets it back
            self._made = (view, made)
        return made

    def free(self) -> None:
        """The unit resharded: the gathered buffers and the tensors the post-hook named go, their
        objects stay for the next gather to refill. So does what the module computed on: the same
        view installed again in backward (activation checkpointing's recomputation) gets it back,
        tied to autograd as in forward, where one made in backward would be made without grad (the
        Parameters shown between forward and backward, leaves, never replace it)."""
        if self._is_gathered:
            for tensor in self._outputs + self._inner:
                free_storage(tensor)
            self._is_gathered = False

    def prepare(self) -> List[torch.Tensor]:
        """The pre-hook's tensors to gather, this rank's (the unit's gather carries them, in bytes:
        gloo gathers no float8, and the gather only moves them), with the buffers their gathered
        copies land in given storage: ``outputs``."""
        inputs, self._metadata = self._pre_all_gather()
        world = comm.group_size(self._group)
        if not self._outputs:
            self._outputs = [torch.empty(t.numel() * t.element_size() * world, dtype=torch.uint8, device=t.device)
                             for t in inputs]
        for tensor in self._outputs + self._inner:
            alloc_storage(tensor)
        self._input_kinds = [(t.dtype, t.shape) for t in inputs]
        return list(inputs)

    @property
    def outputs(self) -> List[torch.Tensor]:
        return self._outputs

    def finish(self) -> None:
        """The gathered copies are in ``outputs``: the post-hook makes the unsharded tensor (the first
        time; afterwards it refills it, ``out=``)."""
        gathered = tuple(output.view(dtype).view(-1, *shape[1:]) for output, (dtype, shape) in zip(self._outputs, self._input_kinds))
        dtype = self._context.param_dtype or self.local.dtype
        post = getattr(self.local, "fsdp_post_all_gather")
        if self._unsharded is None:
            unsharded, inner = post(gathered, self._metadata, dtype)
            self._unsharded = torch.as_strided(unsharded, self._size, contiguous_stride(self._size), storage_offset=0)
            self._inner = list(inner)
        else:
            post(gathered, self._metadata, dtype, out=self._unsharded)
        self._is_gathered = True

    def _pre_all_gather(self) -> Tuple[Tuple[torch.Tensor, ...], Any]:
        """torch's two signatures: the mesh alone, or the mesh, the size, the stride, the module and
        the mixed-precision policy."""
        pre = getattr(self.local, "fsdp_pre_all_gather")
        parameters = len(inspect.signature(pre).parameters)
        if parameters == 1:
            inputs, metadata = pre(self._mesh)
        elif parameters == 5:
            inputs, metadata = pre(self._mesh, self._size, contiguous_stride(self._size), self._module,
                                   self._context.mp_policy)
        else:
            raise AssertionError(  # torch's type and phrase
                f"Invalid fsdp_pre_all_gather: {inspect.signature(pre)}\nExpects fsdp_pre_all_gather(self, mesh: "
                "DeviceMesh, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module, mp_policy: "
                "MixedPrecisionPolicy)"
            )
        if self.local.size() != self._padded_size and any(tensor.size() != self._padded_size for tensor in inputs):
            raise AssertionError(  # torch's type and phrase; unequal inputs would desynchronise the ranks' gathers
                f"When a parameter is unevenly sharded by FSDP (orig size={self._size}, FSDP world size="
                f"{comm.group_size(self._group)}), fsdp_pre_all_gather must return all-gather inputs with the padded "
                f"sharded size {self._padded_size} but got {[tensor.size() for tensor in inputs]}"
            )
        return tuple(inputs), metadata


class _GradientToView(torch.autograd.Function):
    """The unsharded tensor the module computes on, whose gradient goes to ``view`` (the parameter's
    place in the gathered buffer), in the view's dtype."""

    @staticmethod
    def forward(ctx: Any, view: torch.Tensor, unsharded: torch.Tensor) -> torch.Tensor:
        ctx.dtype = view.dtype
        return unsharded.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return plain_gradient(grad, ctx.dtype), None
