"""The fuzzer's ``fully_shard`` stack cases and their runs: a case (plain JSON, drawn by
``test_fuzz.py``) is a stack of residual MLP blocks, a mesh (1-D, HSDP, dp × tp with a
tensor-parallel plan, pp × dp with a pipeline schedule), a shard dim, a mixed precision, gradient
accumulation, resharding after forward block by block and, for fsdp1, the import form (``import
fsdp1`` alone or under ``use_as_torch_fsdp``), trained by fsdp1's ``fully_shard`` or by torch's
(``case["impl"]``) on fresh forked ranks (``_fuzz.run_case``). The test holds fsdp1 to torch's
outcome, bit for bit, on every case torch runs right.
"""

import contextlib
import json
import os
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from _models import pipeline_step, stage_indices

STEPS = 2
BATCH = 4
PG_TIMEOUT_S = 5


class Residual(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _api(case: Dict[str, Any]) -> Tuple[Callable[..., Any], Any, Callable[[], Any]]:
    """``fully_shard``, ``MixedPrecisionPolicy`` and the import form's context."""
    if case["impl"] == "fsdp1":
        import fsdp1

        return fsdp1.fully_shard, fsdp1.MixedPrecisionPolicy, (
            fsdp1.use_as_torch_fsdp if case["form"] == "alias" else contextlib.nullcontext)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    return fully_shard, MixedPrecisionPolicy, contextlib.nullcontext


def _mesh(case: Dict[str, Any]):
    from torch.distributed.device_mesh import init_device_mesh

    kind = case["mesh"]
    if kind == "1d":
        return init_device_mesh("cpu", (case["world_size"],), mesh_dim_names=("dp",))
    names = {"hsdp": ("replicate", "shard"), "dp_tp": ("dp", "tp"), "pp": ("pp", "dp")}[kind]
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=names)


def _shard_kwargs(case: Dict[str, Any], mixed_precision: Any) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = {}
    if case["bf16"]:
        kwargs["mp_policy"] = mixed_precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if case["shard_dim"]:
        from torch.distributed.tensor import Shard

        kwargs["shard_placement_fn"] = lambda param: Shard(case["shard_dim"] if param.ndim > 1 else 0)
    return kwargs


def _run_stack(case: Dict[str, Any], rank: int) -> Dict[str, Any]:
    """The case's training on this rank: its losses and every parameter's full value after it."""
    fully_shard, mixed_precision, in_form = _api(case)
    mesh = _mesh(case)
    torch.manual_seed(case["seed"])
    blocks = [Residual(case["width"], case["hidden"]) for _ in range(case["blocks"])]
    kwargs = _shard_kwargs(case, mixed_precision)
    dp_mesh = mesh["dp"] if case["mesh"] in ("dp_tp", "pp") else mesh
    dp_rank = {"1d": rank, "hsdp": rank, "dp_tp": rank // 2, "pp": rank % 2}[case["mesh"]]  # whose batch
    if case["mesh"] == "pp":
        with in_form():
            return _run_pipeline(case, mesh, blocks, fully_shard, kwargs, dp_rank)
    if case["mesh"] == "dp_tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for block in blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    model = nn.Sequential(*blocks)
    for block, reshard in zip(model, case["reshard_after_forward"]):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, mesh=dp_mesh, **kwargs)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses: List[float] = []
    for step in range(STEPS):
        for micro in range(case["accumulate"]):
            model.set_requires_gradient_sync(micro == case["accumulate"] - 1)
            inputs, targets = _batch(case, step * 10 + micro, dp_rank)
            loss = F.mse_loss(model(inputs).float(), targets)
            loss.backward()
            losses.append(loss.item())
        optim.step()
        optim.zero_grad()
    return {"losses": losses, "final": [p.full_tensor().detach().float().flatten().tolist() for p in model.parameters()]}


def _run_pipeline(case, mesh, blocks, fully_shard, kwargs, dp_rank) -> Dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, schedules

    schedule_class = getattr(schedules, case["schedule"])
    single = issubclass(schedule_class, schedules.PipelineScheduleSingle)
    indices = stage_indices(case["schedule"], mesh["pp"].get_local_rank(), 2)
    stage_count = 2 * len(indices)
    per_stage = len(blocks) // stage_count
    stages, modules = [], []
    for index in indices:
        module = nn.Sequential(*blocks[index * per_stage:(index + 1) * per_stage])
        for block, reshard in zip(module, case["reshard_after_forward"][index * per_stage:]):
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard, **kwargs)
        modules.append(fully_shard(module, mesh=mesh["dp"], **kwargs))
        stages.append(PipelineStage(module, index, stage_count, torch.device("cpu"), group=mesh["pp"].get_group()))
    schedule = schedule_class(stages[0] if single else stages, n_microbatches=case["accumulate"] * 2,
                              loss_fn=lambda output, target: F.mse_loss(output.float(), target))
    optims = [torch.optim.AdamW(module.parameters(), lr=1e-2) for module in modules]
    losses: List[float] = []
    for step in range(STEPS):
        inputs, targets = _batch(case, step, dp_rank, rows=BATCH * case["accumulate"])
        out = pipeline_step(schedule, 0 in indices, stage_count - 1 in indices, inputs, targets)
        losses += [loss.item() for loss in out]
        for optim in optims:
            optim.step()
            optim.zero_grad()
    final = [p.full_tensor().detach().float().flatten().tolist() for module in modules for p in module.parameters()]
    return {"losses": losses, "final": final}


def _batch(case: Dict[str, Any], step: int, dp_rank: int, rows: int = BATCH):
    generator = torch.Generator().manual_seed(case["seed"] * 1000 + step * 10 + dp_rank)
    return torch.randn(rows, case["width"], generator=generator), torch.randn(rows, case["width"], generator=generator)


def rank_main(rank: int, case: Dict[str, Any], out: str) -> None:
    """One rank of one stack case, in a forked process (``_fuzz.run_case``)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=case["world_size"],
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    try:
        outcome: Dict[str, Any] = {"ok": _run_stack(case, rank)}
    except Exception as error:  # noqa: BLE001 - the outcome to compare with torch's
        outcome = {"error": type(error).__name__, "message": str(error), "trace": traceback.format_exc()[-2000:]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    os._exit(0)
