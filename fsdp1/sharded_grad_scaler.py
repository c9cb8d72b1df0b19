"""``ShardedGradScaler``: dynamic loss scaling for fp16 training when each rank holds only part of the
gradients.

``torch.amp.GradScaler`` decides from this rank's gradients alone whether a step overflowed; with
sharded gradients an inf on one rank would let the others step and the ranks would drift apart.
Here the inf/NaN flag is summed over the process group before the step is taken or skipped, so
every rank skips the same steps. Gradients may be fp16 (``keep_low_precision_grads``) and may live
on the CPU while the scale lives on the accelerator (parameter offloading).
"""

from typing import Dict, Iterable, List, Optional, Tuple, Union, overload

import torch

from ._engine import collectives as comm
from ._torch_internals import found_inf_flags, scale_tensor

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN check is agreed across ``process_group`` (by default
    every rank). Arguments and methods are GradScaler's; ``device="cpu"`` works on CPU-only machines."""

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Optional[comm.ProcessGroup] = None,
    ) -> None:
        super().__init__(device, init_scale=init_scale, backoff_factor=backoff_factor, growth_factor=growth_factor,
                         growth_interval=growth_interval, enabled=enabled)
        # Built before init_process_group (as Lightning's FSDP precision plugin does), it takes the
        # default group when it first needs one.
        self.process_group: Optional[comm.ProcessGroup] = (
            process_group if process_group is not None or not comm.is_initialized() else comm.default_group()
        )

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: List[torch.Tensor]) -> List[torch.Tensor]: ...

    @overload
    def scale(self, outputs: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(self, outputs: Union[torch.Tensor, Iterable[torch.Tensor]]) -> Union[torch.Tensor, Iterable[torch.Tensor]]:
        """The outputs multiplied by the scale, each in its own dtype (a bf16 or fp16 loss stays so;
        GradScaler's would promote it to float32)."""
        if isinstance(outputs, torch.Tensor):
            return super().scale(outputs).to(outputs.dtype)
        scaled = super().scale(outputs)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(s.to(o.dtype) for s, o in zip(scaled, outputs))
        return scaled

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> Dict[torch.device, torch.Tensor]:
        # fp16 gradients are the point of keep_low_precision_grads; unscaling them in place is what is asked.
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """GradScaler's ``unscale_``, then the inf/NaN flags summed over the process group, so that
        ``step`` skips on every rank when any rank overflowed. Collective when enabled."""
        if not self.is_enabled():
            return
        super().unscale_(optimizer)
        found = found_inf_flags(self, optimizer)
        # One flag per rank, whatever devices its gradients are on (a rank may hold none), so that
        # every rank issues exactly one collective.
        combined = torch.zeros((), dtype=torch.float32, device=scale_tensor(self).device)
        for flag in found.values():
            combined += flag.to(combined.device).reshape(())
        group = self.process_group if self.process_group is not None else comm.default_group()
        comm.all_reduce(combined, group).wait()
        if not found:
            found[combined.device] = combined
        for flag in found.values():
            flag.copy_(combined)
