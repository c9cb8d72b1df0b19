"""Small models and helpers shared by the multi-rank tests (imported on every rank)."""

import copy
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1
from fsdp1._engine.traversal import unit_paths

from _harness import run_on_ranks

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, HIDDEN = 37, 9, 10, 2, 2, 31
"""Sizes chosen so that no flat parameter divides evenly: every unit (1111 and 887 elements) needs
padding on 2 and 4 ranks."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        # No qkv bias: the key bias cannot change softmax, so its gradient is pure rounding noise that
        # Adam would scale up to lr-sized updates, making any two correct implementations disagree.
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.fc = nn.Linear(D_MODEL, HIDDEN)
        self.out = nn.Linear(HIDDEN, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        return self.head(self.ln_f(self.blocks(x)))


def make_gpt(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


class TiedGPT(TinyGPT):
    """TinyGPT whose output head is the token embedding (as GPT-2's), optionally used a third time by
    an auxiliary head: one Parameter registered in two or three modules of the root unit."""

    def __init__(self, ways: int = 2) -> None:
        super().__init__()
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        self.aux = None
        if ways == 3:
            self.aux = nn.Linear(D_MODEL, VOCAB, bias=False)
            self.aux.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.ln_f(self.blocks(self.tok(idx) + self.pos[: idx.shape[1]]))
        logits = self.head(x)
        return logits if self.aux is None else logits + 0.5 * self.aux(torch.tanh(x))


def make_tied_gpt(ways: int = 2, seed: int = 0) -> TiedGPT:
    torch.manual_seed(seed)
    return TiedGPT(ways)


def batch(step: int, rank: int, world_size: int, batch_size: int = 2):
    """Tokens and targets of one rank for one step; the same on every implementation."""
    gen = torch.Generator().manual_seed(1000 + step * world_size + rank)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def _optimize(model: nn.Module, steps: int, make_optim, batch_of_step) -> List[float]:
    optim = make_optim(model.parameters())
    losses = []
    for step in range(steps):
        loss = lm_loss(model, *batch_of_step(step))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def train_steps(model: nn.Module, optim: torch.optim.Optimizer, first: int, count: int) -> List[float]:
    """Steps ``first`` to ``first + count - 1`` on this rank's batches with ``optim``; the losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(first, first + count):
        loss = lm_loss(model, *batch(step, rank, world))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def train(model: nn.Module, steps: int, world_size: int, rank: int, make_optim=adam) -> List[float]:
    """``steps`` optimizer steps on this rank's batches; the per-step losses."""
    return _optimize(model, steps, make_optim, lambda step: batch(step, rank, world_size))


def global_batch(step: int, world_size: int):
    """Every rank's batch of ``step`` concatenated: what one process sees in place of all ranks."""
    parts = [batch(step, rank, world_size) for rank in range(world_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def train_single_process(model: nn.Module, steps: int, world_size: int, make_optim=adam) -> List[float]:
    """Ground truth: one process over the global batch (the loss is the mean of equal per-rank means)."""
    return _optimize(model, steps, make_optim, lambda step: global_batch(step, world_size))


def fsdp1_full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every original parameter of an fsdp1 model, unsharded, by clean FQN (collective)."""
    full = {}
    for unit, path in unit_paths(model).items():
        handle = unit._handle
        if handle is None:
            continue
        source = handle.local_shard.detach()
        if handle.is_sharded:
            source = torch.empty(handle.layout.unsharded_numel, dtype=source.dtype)
            dist.all_gather_into_tensor(source, handle.local_shard.detach(), group=handle.group)
        for fqn, view in zip(handle.fqns, handle.layout.unflatten(source)):
            full[f"{path}.{fqn}" if path else fqn] = view.clone()
    return full


def torch_fsdp_full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    with TorchFSDP.summon_full_params(model):
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}


def plain_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    module = model.module if isinstance(model, DDP) else model
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def wrap_fsdp1(model: nn.Module, strategy: str = "FULL_SHARD", use_orig_params: bool = False, wrap_classes=(Block,),
               backward_prefetch: Optional[str] = "BACKWARD_PRE", forward_prefetch: bool = False) -> nn.Module:
    """fsdp1 with one unit per instance of ``wrap_classes`` (none if empty) plus the root; enum
    arguments by member name, defaults as torch's."""
    return fsdp1.FullyShardedDataParallel(
        model,
        sharding_strategy=fsdp1.ShardingStrategy[strategy],
        auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy(set(wrap_classes)) if wrap_classes else None,
        backward_prefetch=backward_prefetch and fsdp1.BackwardPrefetch[backward_prefetch],
        forward_prefetch=forward_prefetch,
        use_orig_params=use_orig_params,
    )


def wrap_torch_fsdp(model: nn.Module, strategy: str = "FULL_SHARD", use_orig_params: bool = False, wrap_classes=(Block,),
                    backward_prefetch: Optional[str] = "BACKWARD_PRE", forward_prefetch: bool = False) -> nn.Module:
    """torch's FSDP1, wrapped exactly as ``wrap_fsdp1`` wraps, on CPU."""
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return TorchFSDP(
        model,
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy(set(wrap_classes)) if wrap_classes else None,
        backward_prefetch=backward_prefetch and BackwardPrefetch[backward_prefetch],
        forward_prefetch=forward_prefetch,
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
    )


def max_relative_error(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for name in a:
        assert a[name].shape == b[name].shape, name
        scale = b[name].abs().max().item() or 1.0
        worst = max(worst, (a[name] - b[name]).abs().max().item() / scale)
    return worst


def relative_errors(xs: List[float], ys: List[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(xs, ys))


def build(copy_of: nn.Module, wrapper: Callable[[nn.Module], nn.Module]) -> nn.Module:
    return wrapper(copy.deepcopy(copy_of))


# ------------------------------------------------------------------ small-model training against an oracle
def step_pair(ours: nn.Module, oracle: nn.Module, make_input, steps: int = 3, no_sync_microbatches: int = 0) -> List[List[float]]:
    """Train both models identically with Adam; fsdp1's and the oracle's losses per step."""
    rank = dist.get_rank()
    optims = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ours, oracle)]
    losses = []
    for step in range(steps):
        step_losses = []
        for model, optim in zip((ours, oracle), optims):
            for micro in range(no_sync_microbatches):
                with model.no_sync():
                    model(make_input(step, rank, micro)).sum().backward()
            loss = model(make_input(step, rank, no_sync_microbatches)).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            step_losses.append(loss.item())
        losses.append(step_losses)
    return losses


def seeded_randn(*shape):
    """``make_input`` for ``step_pair``: a random tensor of ``shape`` seeded by step, rank and microbatch."""

    def make(step, rank, micro):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(step * 100 + rank * 10 + micro))

    return make


def assert_losses_equal(losses: List[List[float]]) -> None:
    """Each step's two losses from ``step_pair`` agree to 1e-5 relative."""
    for ours, oracle in losses:
        assert abs(ours - oracle) <= 1e-5 * max(abs(oracle), 1e-6), losses


class AveragedGrads(nn.Module):
    """Data parallelism by hand: a plain model whose gradients are averaged over the ranks before each
    step. DDP itself is no oracle here: two forwards before two backwards give it wrong gradients
    (4.6e-2 off on the MLP below), silently."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)

    def average_grads(self):
        for param in self.parameters():
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def mlp_input(step: int, rows: int = 4, cols: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's input of ``step`` for ``make_mlp``'s model."""
    rank = dist.get_rank()
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(100 * step + rank), dtype=dtype)


def train_each(models, steps: int = 3, dtype: torch.dtype = torch.float32, after_step=lambda: None) -> List[List[float]]:
    """Adam steps on the MLP's inputs for each model in turn; each model's losses."""
    losses = []
    for model in models:
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses.append([])
        for step in range(steps):
            loss = model(mlp_input(step, dtype=dtype)).square().mean()
            loss.backward()
            if isinstance(model, AveragedGrads):
                model.average_grads()
            optim.step()
            optim.zero_grad()
            losses[-1].append(loss.item())
            after_step()
    return losses


# ------------------------------------------------------------------ fully_shard (torch's FSDP2 API)
def shard_gpt(model, shard, head_group=False, **kwargs):
    """Blocks first, then (``head_group``) the final norm and the head as one group, then the root, as
    torch's documentation does."""
    for block in model.blocks:
        shard(block, **kwargs)
    if head_group:
        shard([model.ln_f, model.head], **kwargs)
    shard(model, **kwargs)
    return model


def torchs_fully_shard():
    """torch's own ``fully_shard`` (FSDP2), imported on first use."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def fully_shard_of(impl):
    """``fully_shard`` of ``impl``: ``"fsdp1"`` or ``"torch"``."""
    if impl == "fsdp1":
        return fsdp1.fully_shard
    return torchs_fully_shard()


def run_both(body, *args, world_size=2):
    """Rank 0's result of ``body(impl, *args)`` under fsdp1's ``fully_shard`` and under torch's."""
    return tuple(run_on_ranks(world_size, body, impl, *args)[0] for impl in ("fsdp1", "torch"))


def full_grads(model):
    """The full gradient of every DTensor parameter of a ``fully_shard`` model (None where it has none)."""
    return [None if p.grad is None else p.grad.full_tensor() for p in model.parameters()]


def same_tensors(xs, ys):
    """Equal lengths and, pairwise, both None or bitwise equal tensors."""
    return len(xs) == len(ys) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(xs, ys)
    )


class Trunk(TinyGPT):
    """torchtitan's chunked loss: the model's forward stops before the head, which runs per chunk."""

    def forward(self, idx):
        return self.ln_f(self.blocks(self.tok(idx) + self.pos[: idx.shape[1]]))


def make_trunk():
    torch.manual_seed(0)
    return Trunk()


def local_shards(model):
    """Copies of this rank's rows of every DTensor parameter of a ``fully_shard`` model."""
    return [p.to_local().detach().clone() for p in model.parameters()]


def fully_shard_pair_trained(mode):
    """fsdp1's and torch's ``fully_shard`` on the same GPT, trained 3 steps: on a 2-D mesh (``hybrid``),
    with explicit prefetching (``prefetch``), without resharding (``no_reshard``) or with ln_f and head
    as one group (``list``). Whether placements match, both losses, whether the shards match."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    kwargs = {}
    if mode == "hybrid":
        kwargs["mesh"] = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    if mode == "no_reshard":
        kwargs["reshard_after_forward"] = False
    models = []
    for shard in (fsdp1.fully_shard, torchs_fully_shard()):
        model = make_gpt()
        if mode == "list":  # one group of two modules: returned as a list, both swapped
            kinds = [type(m).__name__ for m in shard([model.ln_f, model.head])]
        models.append(shard_gpt(model, shard, **kwargs))
    if mode == "prefetch":
        for model in models:
            blocks = list(model.blocks)
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1: i + 2])
                block.set_modules_to_backward_prefetch(blocks[i - 1: i] if i else [])
    placements = [p.placements for p in models[0].parameters()] == [p.placements for p in models[1].parameters()]
    losses = [train(model, 3, world_size, rank) for model in models]
    same = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(*(m.parameters() for m in models)))
    if mode == "list":
        same = same and kinds == ["FSDPLayerNorm", "FSDPLinear"]
    return placements, losses, same


def fully_shard_against_oracle(pattern):
    """fully_shard and DDP (or torch's fully_shard) doing the same thing; what each trained."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = []
    for wrap in ("fully_shard", "ddp" if pattern == "optimizer_after_eval" else "torch_fully_shard"):
        torch.manual_seed(0)
        if pattern == "meta_init":
            with torch.device("meta"):
                model = make_gpt()
        else:
            model = make_gpt()
        if pattern == "frozen_root":  # frozen parts of the root, which stays gathered for backward
            model.tok.requires_grad_(False)
            model.head.bias.requires_grad_(False)
        if wrap == "fully_shard":
            model = shard_gpt(model, fsdp1.fully_shard)
        elif wrap == "torch_fully_shard":
            model = shard_gpt(model, torchs_fully_shard())
        if pattern == "meta_init":
            model.to_empty(device="cpu")
            torch.manual_seed(1)
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
            with torch.no_grad():
                model.pos.normal_()
        model = DDP(model) if wrap == "ddp" else model
        if pattern == "optimizer_after_eval":  # an evaluation forward before the optimizer exists
            with torch.no_grad():
                model(batch(0, rank, world_size)[0])
        optim = adam(model.parameters())
        losses = []
        for step in range(3):
            loss = lm_loss(model, *batch(step, rank, world_size))
            loss.backward()
            if pattern == "optimizer_after_eval":  # a metric before clipping
                with torch.no_grad():
                    model(batch(step, rank, world_size)[0])
                norm = nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                losses.append(norm.full_tensor().item() if isinstance(norm, DTensor) else norm.item())
            if pattern == "frozen_root" and step == 1:
                model_ = model.module if wrap == "ddp" else model
                model_.head.bias.requires_grad_(True)  # unfrozen between steps
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        named = (model.module if wrap == "ddp" else model).named_parameters()
        results.append((losses, {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in named}))
    (ours, ours_params), (oracle, oracle_params) = results
    return ours, oracle, max((ours_params[n] - oracle_params[n]).abs().max().item() for n in oracle_params)


# ------------------------------------------------------------------ one script under torch's FSDP1 and under fsdp1
IMPLEMENTATIONS = ("torch", "fsdp1")


def fsdp_api(name):
    """The package a script imports as ``fsdp``, and the constructor arguments CPU needs there."""
    if name == "torch":
        import torch.distributed.fsdp as torch_fsdp
        import torch.distributed.fsdp.wrap  # noqa: F401 - torch_fsdp.wrap

        return torch_fsdp, {"device_id": torch.device("cpu")}
    return fsdp1, {}


class LinearNet(nn.Module):
    """Two Linears in a row: the small model the torch-FSDP1-vs-fsdp1 comparisons wrap."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        return self.b(self.a(x))


def outcome_of(call):
    """``call()``'s exception type name (None if it returns) and the warning categories it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call()
            raised = None
        except Exception as error:  # noqa: BLE001 - the type is the result
            raised = type(error).__name__
    return raised, sorted({w.category.__name__ for w in caught})


def same_values(a, b):
    """Equal structure and values, tensors bitwise."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def fsdp_strategy(name, strategy):
    """The ``ShardingStrategy`` member of that name in ``name``'s package."""
    fsdp, _ = fsdp_api(name)
    return fsdp.ShardingStrategy[strategy]


def fsdp_wrapped(name, module, **kwargs):
    """``module`` wrapped by ``name``'s FullyShardedDataParallel (on CPU)."""
    fsdp, cpu = fsdp_api(name)
    return fsdp.FullyShardedDataParallel(module, **cpu, **kwargs)


def summoned_full_params(name, model):
    """Copies of the full parameters, by name, inside ``name``'s ``summon_full_params``."""
    fsdp, _ = fsdp_api(name)
    with fsdp.FullyShardedDataParallel.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def stage_indices(schedule_name, pp_rank, pp_size):
    """The pipeline stages one rank holds under torch's ``schedule_name``: one for single-stage
    schedules, two (looped, or V-shaped for the V schedules) for the others."""
    from torch.distributed.pipelining import schedules

    if issubclass(getattr(schedules, schedule_name), schedules.PipelineScheduleSingle):
        return [pp_rank]
    if schedule_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank, pp_rank + pp_size]


def pipeline_step(schedule, is_first, is_last, inputs, targets):
    """One schedule step on this rank (the first stage takes the inputs, the last the targets); the
    losses of the micro-batches where this rank computes them."""
    losses = []
    if is_first and is_last:
        schedule.step(inputs, target=targets, losses=losses)
    elif is_first:
        schedule.step(inputs)
    elif is_last:
        schedule.step(target=targets, losses=losses)
    else:
        schedule.step()
    return [loss.detach() for loss in losses]
