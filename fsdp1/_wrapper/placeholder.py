"""What the module shows in place of an original parameter whose unit is sharded (use_orig_params=False).

The handle installs these; they answer shape, dtype and device, and turn any other use into an error
that names the parameter and the fix, where a view of the freed unsharded storage would read out of
bounds.
"""

import torch

from .._torch_internals import torch_function_subclass_disabled, wrapper_subclass


class ShardedParamPlaceholder(torch.Tensor):
    """What ``module.<name>`` holds for an original parameter while its unit is sharded and
    use_orig_params=False: the parameter's data is spread over the ranks, so nothing local can be
    read (a view of the freed unsharded storage would read out of bounds). Shape, dtype and device
    answer; any other use raises an error naming the parameter and the fix."""

    # The getters of Tensor's metadata attributes, which are descriptors on the class (the stubs type
    # them as the values they give).
    _METADATA = frozenset(
        [
            torch.Tensor.shape.__get__,  # type: ignore[attr-defined]  # a descriptor at runtime
            torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]  # a descriptor at runtime
            torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]  # a descriptor at runtime
            torch.Tensor.device.__get__,
            torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined]  # a descriptor at runtime
            torch.Tensor.size,
            torch.Tensor.dim,
            torch.Tensor.numel,
        ]
    )
    _fqn: str

    @staticmethod
    def __new__(cls, fqn: str, shape: torch.Size, like: torch.Tensor) -> "ShardedParamPlaceholder":
        placeholder = wrapper_subclass(cls, shape, like)
        placeholder._fqn = fqn
        return placeholder

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls._METADATA:
            with torch_function_subclass_disabled():
                return func(*args, **(kwargs or {}))
        placeholder = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, cls))
        raise RuntimeError(
            f"fsdp1: parameter '{placeholder._fqn}' is sharded across the ranks outside its unit's forward "
            "and backward (use_orig_params=False), so this rank has no full value to use here. Read or change "
            "it inside `with FullyShardedDataParallel.summon_full_params(model):` (with rank0_only=True only rank "
            "0 gets full values), or initialise it with "
            "`model.apply(fn)`, which gathers it for fn; with use_orig_params=True the parameter stays "
            "readable as this rank's shard."
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]  # the stub leaves out func
        cls.__torch_function__(func, types, args, kwargs)

    def __repr__(self) -> str:  # type: ignore[override]  # Tensor's takes tensor_contents
        return f"ShardedParamPlaceholder('{self._fqn}', shape={tuple(self.shape)}: sharded, use summon_full_params)"
