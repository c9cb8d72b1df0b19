"""The fuzzer's cases and their two runs: a case (plain JSON, drawn by
``test_fuzz.py``'s hypothesis strategies) is a module tree, a wrap policy, a world size, options and
a program of everyday and misuse calls, run through ``FullyShardedDataParallel`` or ``fully_shard``. ``run_case`` runs it on fresh processes, forked from a
forkserver that imported torch once (a spawned process costs ~5 s here, a fork ~50 ms), each with a
hard deadline; ``replay`` runs the same program on one process over the global batch. The test then
holds fsdp1 to: every rank matches the replay, or every rank raised the same named error.
"""

import functools
import json
import os
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from _harness import forkserver

BATCH = 3
LR = 0.1
MAX_NORM = 0.05
PG_TIMEOUT_S = 2


# ---------------------------------------------------------------------------------------------- models
class Tied(nn.Module):
    """Two Linear layers sharing one weight (each its own bias)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(width, width), nn.Linear(width, width)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


class Unused(nn.Module):
    """A layer forward never calls beside one it does."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(width, out), nn.Linear(width, out)

    def forward(self, x):
        return self.used(x)


class Buffered(nn.Module):
    """Scales by a buffer (persistent or not) and adds a parameter with no elements."""

    def __init__(self, width: int, persistent: bool) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width), persistent=persistent)
        self.nothing = nn.Parameter(torch.empty(0))

    def forward(self, x):
        return x * self.scale + self.nothing.sum()


class Net(nn.Module):
    def __init__(self, spec: Dict[str, Any]) -> None:
        super().__init__()
        width = spec["width"]
        self.embed = nn.Embedding(spec["vocab"], width) if spec["vocab"] else None
        self.body, width = _blocks(spec["blocks"], width)
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x).sum(dim=1)
        return self.head(torch.tanh(self.body(x)))


def _blocks(specs: List[Dict[str, Any]], width: int):
    modules = []
    for spec in specs:
        kind = spec["k"]
        if kind == "linear":
            module = nn.Linear(width, spec["out"], bias=spec["bias"])
            module.requires_grad_(not spec["frozen"])
            width = spec["out"]
        elif kind == "seq":
            module, width = _blocks(spec["blocks"], width)
        elif kind == "norm":
            module = nn.LayerNorm(width)
        elif kind == "tied":
            module = Tied(width)
        elif kind == "unused":
            module = Unused(width, spec["out"])
            width = spec["out"]
        else:
            module = Buffered(width, spec["persistent"])
        modules.append(module)
    return nn.Sequential(*modules), width


def build(case: Dict[str, Any]) -> nn.Module:
    torch.manual_seed(case["seed"])
    return Net(case["model"])


def batch(case: Dict[str, Any], step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(case["seed"] * 1000 + step * 10 + rank)
    vocab = case["model"]["vocab"]
    if vocab:
        return torch.randint(0, vocab, (BATCH, 2), generator=generator)
    return torch.randn(BATCH, case["model"]["width"], generator=generator)


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


# ---------------------------------------------------------------------------------------------- fsdp1 run
def _policy(case: Dict[str, Any]):
    import fsdp1

    wrap = case["wrap"]
    if wrap["policy"] == "classes":
        classes = {"Linear": nn.Linear, "Sequential": nn.Sequential, "LayerNorm": nn.LayerNorm, "Tied": Tied,
                   "Unused": Unused, "Buffered": Buffered}
        return fsdp1.wrap.ModuleWrapPolicy({classes[name] for name in wrap["classes"]})
    if wrap["policy"] == "size":
        return functools.partial(fsdp1.wrap.size_based_auto_wrap_policy, min_num_params=wrap["min_params"])
    return None


def _splits_a_tie(module: nn.Module, model: nn.Module) -> bool:
    """Whether a parameter of ``module`` is also registered outside it (fully_shard refuses to shard
    such a module on its own, as torch's does: one weight cannot be split over two groups)."""
    inside = {id(p) for p in module.parameters()}
    own = {id(m) for m in module.modules()}
    return any(id(p) in inside for m in model.modules() if id(m) not in own for p in m.parameters(recurse=False))


def _fully_sharded(case: Dict[str, Any]) -> nn.Module:
    """fully_shard's version of the case: each module the policy picks (children first; a size policy
    picks the Sequentials holding at least ``min_params``) unless it would split a tied weight, then
    the root."""
    import fsdp1

    model = build(case)
    wrap, options = case["wrap"], case["options"]
    kwargs: Dict[str, Any] = {"reshard_after_forward": options["reshard_after_forward"]}
    if wrap["policy"] == "classes":
        picked = [m for m in model.modules() if type(m).__name__ in wrap["classes"] and m is not model]
    elif wrap["policy"] == "size":
        picked = [m for m in model.modules() if isinstance(m, nn.Sequential)
                  and sum(p.numel() for p in m.parameters()) >= wrap["min_params"]]
    else:
        picked = []
    for module in reversed(picked):  # modules() lists parents first
        if not _splits_a_tie(module, model):
            fsdp1.fully_shard(module, **kwargs)
    return fsdp1.fully_shard(model, **kwargs)


def _wrapped(case: Dict[str, Any]) -> nn.Module:
    import fsdp1

    options = case["options"]
    if options["api"] == "fully_shard":
        return _fully_sharded(case)
    return fsdp1.FullyShardedDataParallel(
        build(case), auto_wrap_policy=_policy(case), use_orig_params=options["use_orig_params"],
        sharding_strategy=fsdp1.ShardingStrategy[options["sharding"]], sync_module_states=options["sync_module_states"],
    )


def _run_program(case: Dict[str, Any], rank: int) -> Dict[str, Any]:
    """The program on this rank: what every step returned, and the final parameters."""
    import torch.distributed as dist

    import fsdp1

    FSDP = fsdp1.FullyShardedDataParallel
    model = _wrapped(case)
    fully_sharded = case["options"]["api"] == "fully_shard"
    summon = model.summon_full_params if fully_sharded else lambda: FSDP.summon_full_params(model)
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=case["options"]["momentum"])
    seen: List[Any] = []
    for step, op in enumerate(case["program"]):
        x = batch(case, step, rank)
        if op in ("step", "clip", "metric_between"):
            loss = loss_of(model(x))
            loss.backward()
            if op == "metric_between":
                with torch.no_grad():
                    seen.append(loss_of(model(batch(case, step, 9))).item())
            if op == "clip" and fully_sharded:  # the DTensor gradients' own norm
                norm = nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], MAX_NORM)
                seen.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
            elif op == "clip":
                seen.append(model.clip_grad_norm_(MAX_NORM).item())
            optim.step()
            optim.zero_grad()
            seen.append(loss.item())
        elif op == "no_sync":
            with model.no_sync():
                loss_of(model(batch(case, step, rank + 5))).backward()
            loss = loss_of(model(x))
            loss.backward()
            optim.step()
            optim.zero_grad()
            seen.append(loss.item())
        elif op == "eval":
            with torch.no_grad():
                seen.append(loss_of(model(x)).item())
        elif op in ("sd_full", "sd_sharded") and fully_sharded:  # DTensors; full: plain tensors, which fsdp1 loads
            state = model.state_dict()
            if op == "sd_full":
                state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
            model.load_state_dict(state)
        elif op in ("sd_full", "sd_sharded"):
            kind = fsdp1.StateDictType.FULL_STATE_DICT if op == "sd_full" else fsdp1.StateDictType.SHARDED_STATE_DICT
            with FSDP.state_dict_type(model, kind):
                model.load_state_dict(model.state_dict())
        elif op == "summon":
            with summon():
                seen.append({name: p.detach().flatten().tolist() for name, p in model.named_parameters()})
        elif op in ("nested_summon", "forward_in_summon"):  # refused, and the model as it was
            try:
                with summon():
                    if op == "nested_summon":
                        summon().__enter__()
                    else:
                        model(x)
            except Exception as error:  # noqa: BLE001 - compared with the replay's "refused"
                seen.append("refused" if str(error).startswith("fsdp1") else f"{type(error).__name__}: {error}")
        elif op == "sd_rank0_only":
            if dist.get_rank() == 0:
                model.state_dict()
            loss_of(model(x)).backward()
    if fully_sharded:
        final = {name: (value.full_tensor() if isinstance(value, DTensor) else value).flatten().tolist()
                 for name, value in model.state_dict().items()}
    else:
        with FSDP.state_dict_type(model, fsdp1.StateDictType.FULL_STATE_DICT):
            final = {name: value.flatten().tolist() for name, value in model.state_dict().items()}
    return {"seen": seen, "final": final}


def rank_main(rank: int, case: Dict[str, Any], out: str) -> None:
    """One rank of one case, in a forked process: join a fresh gloo group, run, write the outcome."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    world_size = case["world_size"]
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))  # a file store: no port to race for
    try:
        outcome: Dict[str, Any] = {"ok": _run_program(case, rank)}
    except Exception as error:  # noqa: BLE001 - the outcome to compare across ranks
        outcome = {"error": type(error).__name__, "message": str(error), "trace": traceback.format_exc()[-2000:]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    os._exit(0)  # no destroy_process_group: a broken group's teardown can wait for the peers


# ---------------------------------------------------------------------------------------------- launching
def run_case(case: Dict[str, Any], deadline_s: float = 45, target: Callable[[int, Dict[str, Any], str], None] = rank_main
             ) -> Dict[str, Any]:
    """Every rank's outcome of ``target`` (each rank's run; this module's by default), or
    ``{"hang": ranks}`` (killed at the deadline) / ``{"crash": ranks}`` (ended without an outcome)."""
    context = forkserver()
    with tempfile.TemporaryDirectory() as out:
        procs = [context.Process(target=target, args=(rank, case, out), daemon=True)
                 for rank in range(case["world_size"])]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + deadline_s
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        outcomes = {rank: json.loads(Path(out, f"rank{rank}.json").read_text())
                    for rank in range(len(procs)) if Path(out, f"rank{rank}.json").exists()}
    if hung:
        return {"hang": hung, "outcomes": outcomes}
    if len(outcomes) < len(procs):
        return {"crash": sorted(set(range(len(procs))) - set(outcomes)), "outcomes": outcomes}
    return {"outcomes": [outcomes[rank] for rank in range(len(procs))]}


# ---------------------------------------------------------------------------------------------- replay
def replay(case: Dict[str, Any]) -> Dict[str, Any]:
    """The program on one process over the global batch: each rank's loss averaged, as the gradient
    fsdp1 reduces is; what each rank saw per step; the final parameters."""
    model = build(case)
    world_size = case["world_size"]
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=case["options"]["momentum"])
    seen: List[List[Any]] = [[] for _ in range(world_size)]

    def backward_on(step_batches) -> List[float]:
        losses = [loss_of(model(x)) for x in step_batches]
        (sum(losses) / world_size).backward()
        return [loss.item() for loss in losses]

    for step, op in enumerate(case["program"]):
        batches = [batch(case, step, rank) for rank in range(world_size)]
        if op in ("step", "clip", "metric_between"):
            losses = backward_on(batches)
            if op == "metric_between":
                with torch.no_grad():
                    metric = loss_of(model(batch(case, step, 9))).item()
                for rank in range(world_size):
                    seen[rank].append(metric)
            if op == "clip":
                norm = nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], MAX_NORM).item()
                for rank in range(world_size):
                    seen[rank].append(norm)
            optim.step()
            optim.zero_grad()
            for rank in range(world_size):
                seen[rank].append(losses[rank])
        elif op == "no_sync":
            backward_on([batch(case, step, rank + 5) for rank in range(world_size)])
            losses = backward_on(batches)
            optim.step()
            optim.zero_grad()
            for rank in range(world_size):
                seen[rank].append(losses[rank])
        elif op == "eval":
            with torch.no_grad():
                for rank in range(world_size):
                    seen[rank].append(loss_of(model(batches[rank])).item())
        elif op == "sd_rank0_only":  # one rank: a forward and backward, its gradient kept
            backward_on(batches)
        elif op in ("nested_summon", "forward_in_summon"):
            for rank in range(world_size):
                seen[rank].append("refused")
        elif op == "summon":
            snapshot = {name: p.detach().flatten().tolist() for name, p in model.named_parameters()}
            for rank in range(world_size):
                seen[rank].append(snapshot)
    final = {name: value.flatten().tolist() for name, value in model.state_dict().items()}
    return {"seen": seen, "final": final}
