"""``FlatParameter``: the tensor a unit's parameters are flattened into, as torch's FSDP1 names it."""

from typing import Tuple

import torch
from torch import nn

from .views import FLATTENED


class _FlatParameterMeta(type(nn.Parameter)):  # type: ignore[misc]  # a metaclass derived from a dynamic type
    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, torch.Tensor) and getattr(instance, "_is_flat_param", False)


class FlatParameter(nn.Parameter, metaclass=_FlatParameterMeta):
    """A unit's flattened parameters; ``FlatParameter(data)`` returns a plain ``nn.Parameter``.

    Being an exact ``nn.Parameter`` keeps optimizers on their fast foreach path (they choose it by
    exact type); ``isinstance(p, FlatParameter)`` still works through the marker below. These are the
    only attributes fsdp1 sets on a tensor, once, at construction.
    """

    _is_flat_param: bool
    _fqns: Tuple[str, ...]
    _shapes: Tuple[torch.Size, ...]
    _numels: Tuple[int, ...]
    _unpadded_unsharded_size: torch.Size
    _padded_unsharded_size: torch.Size
    _sharded_size: torch.Size
    _shard_numel_padded: int

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True) -> nn.Parameter:  # type: ignore[misc]  # returns the base type on purpose
        return FlatParameter.mark(nn.Parameter(data, requires_grad=requires_grad))

    @staticmethod
    def mark(param: nn.Parameter) -> nn.Parameter:
        """``param`` becomes a FlatParameter (also one ``nn.Module._apply`` made in a conversion)."""
        param._is_flat_param = True  # type: ignore[attr-defined]  # the marker __instancecheck__ reads
        setattr(param, FLATTENED, True)  # torch's marker of a flattened parameter, which Lightning reads
        return param
