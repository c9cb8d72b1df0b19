"""Tests ``fully_shard`` over tensor-parallel parameters (FSDP + TP): blocks made tensor-parallel
with ``parallelize_module`` on the ``tp`` dim of a (dp=2, tp=2) mesh, then sharded over its ``dp``
dim, against torch's ``fully_shard`` doing the same on the same mesh: the parameters' placements,
local and global shapes, the losses and the parameters after training, bit for bit, under the
everyday variations (not resharding after forward, bf16, accumulation, clipping, activation
checkpointing), and the state dicts and DCP checkpoints, between the two and between mesh shapes."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

import fsdp1

from _harness import run_on_ranks
from _models import fully_shard_of, same_values

VOCAB, DIM, HIDDEN = 11, 8, 12


class FeedForward(nn.Module):
    """``checkpointed``: its MLP recomputed in backward from inside the sharded module (reentrant or
    not), as ``checkpoint_wrapper`` or Transformers' gradient checkpointing do."""

    def __init__(self, checkpointed=None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.checkpointed = checkpointed

    def forward(self, x):
        if self.checkpointed is None:
            return x + self.mlp(self.norm(x))
        return x + checkpoint(self.mlp, self.norm(x), use_reentrant=self.checkpointed == "reentrant")

    def mlp(self, x):
        return self.down(F.relu(self.up(x)))


class TensorParallelLM(nn.Module):
    """Embedding, two feed-forward blocks (tensor-parallel: ``up`` column-wise, ``down`` row-wise,
    whose bias stays replicated and gets partial gradients), head."""

    def __init__(self, checkpointed=None) -> None:
        """``checkpointed``: "blocks" recomputes each sharded block from outside it; "inside" and
        "inside, reentrant" recompute each block's MLP from inside it."""
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        inside = {"inside": "not reentrant", "inside, reentrant": "reentrant"}.get(checkpointed)
        self.blocks = nn.ModuleList([FeedForward(inside), FeedForward(inside)])
        self.head = nn.Linear(DIM, VOCAB)
        self.checkpointed = checkpointed == "blocks"

    def forward(self, idx):
        h = self.emb(idx)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        return self.head(h)


def tensor_parallel_model(impl, mesh, dp_mesh, checkpointed=None, **kwargs):
    """The model made tensor-parallel over ``mesh["tp"]``, then each block and the root sharded over
    ``dp_mesh`` by ``impl``'s ``fully_shard``."""
    fully_shard = fully_shard_of(impl)
    torch.manual_seed(0)
    model = TensorParallelLM(checkpointed)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=dp_mesh, **kwargs)
    return fully_shard(model, mesh=dp_mesh, **kwargs)


def tokens(step, dp_rank):
    """One data-parallel rank's batch: the same on every tensor-parallel rank of it."""
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(100 * step + dp_rank))


def loss_of(model, idx):
    return F.cross_entropy(model(idx).float().flatten(0, 1), idx.flatten())


def placements_of(model):
    return [(name, tuple(p.placements), tuple(p.to_local().shape), tuple(p.shape)) for name, p in model.named_parameters()]


def full_values(model):
    return [p.full_tensor().detach() for p in model.parameters()]


def clip_grad_norm(model, max_norm):
    """Clipping over gradients on meshes of two shapes ((dp,) and (dp, tp)), which torch's
    ``clip_grad_norm_`` cannot stack: each gradient's norm is made whole first, as torchtitan's
    clipping does for a model whose parameters live on several meshes."""
    params = [p for p in model.parameters() if p.grad is not None]
    norms = [torch.linalg.vector_norm(p.grad).full_tensor() for p in params]
    total = torch.linalg.vector_norm(torch.stack(norms))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)
    return total


def _dp_tp_mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _mp_policy(impl):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = fsdp1.MixedPrecisionPolicy if impl == "fsdp1" else MixedPrecisionPolicy
    return {"mp_policy": policy(param_dtype=torch.bfloat16)}


def _trained(impl, variant):
    if variant == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        dp_mesh = mesh["replicate", "shard"]
        dp_rank = 2 * mesh["replicate"].get_local_rank() + mesh["shard"].get_local_rank()
    else:
        mesh = _dp_tp_mesh()
        dp_mesh = mesh["dp"]
        dp_rank = mesh["dp"].get_local_rank()
    kwargs = {"reshard_after_forward": False} if variant == "kept gathered" else {}
    if variant == "bf16":
        kwargs.update(_mp_policy(impl))
    checkpointed = variant.removeprefix("checkpointed ") if variant.startswith("checkpointed") else None
    model = tensor_parallel_model(impl, mesh, dp_mesh, checkpointed=checkpointed, **kwargs)
    shown = placements_of(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(3):
        if variant == "accumulated":
            model.set_requires_gradient_sync(False)
            loss_of(model, tokens(step + 10, dp_rank)).backward()
            model.set_requires_gradient_sync(True)
        loss = loss_of(model, tokens(step, dp_rank))
        loss.backward()
        if variant == "clipped":
            norms.append(clip_grad_norm(model, 0.5))
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return shown, losses, norms, full_values(model)


def _same_as_torch(variant):
    return same_values(_trained("fsdp1", variant), _trained("torch", variant))


@pytest.mark.parametrize("variant", ["resharded", "kept gathered", "bf16", "accumulated", "clipped", "checkpointed blocks",
                                     "checkpointed inside", "checkpointed inside, reentrant"])
def test_fsdp_over_tensor_parallel_trains_as_torchs(variant):
    assert run_on_ranks(4, _same_as_torch, variant) == [True] * 4


def _placements():
    mesh = _dp_tp_mesh()
    model = tensor_parallel_model("fsdp1", mesh, mesh["dp"])
    return [(name, [str(p) for p in placements], local, shape) for name, placements, local, shape in placements_of(model)]


def test_hsdp_over_tensor_parallel_trains_as_torchs():
    """8 ranks: (replicate=2, shard=2, tp=2), each parameter sharded over ``shard``, all-reduced over
    ``replicate``."""
    assert run_on_ranks(8, _same_as_torch, "hsdp") == [True] * 8


def test_tensor_parallel_parameters_are_placed_as_torchs():
    """The column-parallel weight is split twice along dim 0: by the data-parallel dim of each
    tensor-parallel part (``_StridedShard``); the row-parallel weight along both dims."""
    shown = dict((name, rest) for name, *rest in run_on_ranks(4, _placements)[0])
    assert shown["blocks.0.up.weight"] == [["_S(0, 2)", "S(0)"], (3, 8), (12, 8)]
    assert shown["blocks.0.down.weight"] == [["S(0)", "S(1)"], (4, 6), (8, 12)]
    assert shown["blocks.0.down.bias"] == [["S(0)", "R"], (4,), (8,)]
    assert shown["emb.weight"] == [["S(0)"], (6, 8), (11, 8)]


def _unsharded_parameters_are_tensor_parallel():
    mesh = _dp_tp_mesh()
    model = tensor_parallel_model("fsdp1", mesh, mesh["dp"])
    model.blocks[0].unshard()
    up = model.blocks[0].up.weight
    shown = (isinstance(up, nn.Parameter), isinstance(up, DTensor), up.device_mesh == mesh["tp"],
             [str(p) for p in up.placements], tuple(up.to_local().shape), tuple(up.shape))
    model.blocks[0].reshard()
    return shown


def test_unsharded_parameters_are_the_tensor_parallel_dtensors():
    """Gathered over the data-parallel dim, a parameter is the tensor-parallel DTensor it was."""
    assert run_on_ranks(4, _unsharded_parameters_are_tensor_parallel)[0] == (True, True, True, ["S(0)"], (6, 8), (12, 8))


def _state_dicts(impl):
    mesh = _dp_tp_mesh()
    model = tensor_parallel_model(impl, mesh, mesh["dp"])
    loss_of(model, tokens(0, mesh["dp"].get_local_rank())).backward()
    state = model.state_dict()
    return [(key, type(value).__name__, [str(p) for p in value.placements], tuple(value.to_local().shape),
             value.to_local().clone()) for key, value in state.items()]


def test_state_dict_is_torchs():
    """Keys, placements, local shapes and values of every entry equal torch's."""
    ours, theirs = run_on_ranks(4, _state_dicts, "fsdp1"), run_on_ranks(4, _state_dicts, "torch")
    assert all(same_values(a, b) for a, b in zip(ours, theirs))


def _dcp_round_trip(writer, reader, directory, read_mesh):
    """``writer`` trains a step on (dp=2, tp=2) and saves model and optimizer with DCP; ``reader``
    loads them on ``read_mesh`` ("dp_tp", or "dp" over all 4 ranks) and both take one more step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = _dp_tp_mesh()
    model = tensor_parallel_model(writer, mesh, mesh["dp"])
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_of(model, tokens(0, mesh["dp"].get_local_rank())).backward()
    optim.step()
    optim.zero_grad()
    model_state, optim_state = get_state_dict(model, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    written = full_values(model)
    if read_mesh == "dp_tp":
        loaded = tensor_parallel_model(reader, mesh, mesh["dp"])
    else:
        loaded = fully_shard_of(reader)(TensorParallelLM(), mesh=init_device_mesh("cpu", (4,)))
    loaded_optim = torch.optim.Adam(loaded.parameters(), lr=1e-2)
    model_state, optim_state = get_state_dict(loaded, loaded_optim)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    set_state_dict(loaded, loaded_optim, model_state_dict=model_state, optim_state_dict=optim_state)
    dist.barrier()
    return same_values(full_values(loaded), written), same_values(adam_state(loaded, loaded_optim), adam_state(model, optim))


def adam_state(model, optim):
    """Every parameter's full Adam moments and step count, in parameter order."""
    return [[optim.state[p][key].full_tensor() if isinstance(optim.state[p][key], DTensor) else optim.state[p][key]
             for key in ("step", "exp_avg", "exp_avg_sq")] for p in model.parameters()]


@pytest.mark.parametrize("writer,reader", [("fsdp1", "torch"), ("torch", "fsdp1"), ("fsdp1", "fsdp1")])
def test_dcp_checkpoint_moves_between_fsdp1_and_torch(writer, reader, tmp_path):
    """Written by one on (dp=2, tp=2), read by the other on the same mesh: model and optimizer state
    bit for bit."""
    for same_params, same_optim_state in run_on_ranks(4, _dcp_round_trip, writer, reader, str(tmp_path), "dp_tp"):
        assert same_params
        assert same_optim_state


def test_dcp_checkpoint_of_fsdp_and_tp_loads_on_another_mesh(tmp_path):
    """Written on (dp=2, tp=2), read by plain fully_shard over 4 ranks: the same parameters and
    optimizer state."""
    for same_params, same_optim_state in run_on_ranks(4, _dcp_round_trip, "fsdp1", "fsdp1", str(tmp_path), "dp"):
        assert same_params
        assert same_optim_state


# ------------------------------------------------------------------ dp_mesh_dims: parameters that are DTensors on the whole mesh
class SpmdFeedForward(nn.Module):
    def __init__(self, checkpointed) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.checkpointed = checkpointed

    def forward(self, x):
        return x + (checkpoint(self.mlp, x, use_reentrant=False) if self.checkpointed else self.mlp(x))

    def mlp(self, x):
        return self.down(F.relu(self.up(x)))


class SpmdModel(nn.Module):
    def __init__(self, checkpointed=False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([SpmdFeedForward(checkpointed), SpmdFeedForward(checkpointed)])
        self.head = nn.Linear(DIM, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


SPMD_MESHES = {
    "dp, tp": ((2, 2), ("dp", "tp"), {"shard": "dp"}),
    "replicate, shard, tp": ((2, 2, 2), ("replicate", "shard", "tp"), {"shard": "shard", "replicate": "replicate"}),
    "two shard dims, tp": ((2, 2, 2), ("dp", "cp", "tp"), {"shard": ("dp", "cp")}),
    "replicas only, tp": ((2, 2), ("dp", "tp"), {"replicate": "dp"}),
    "dp, tp, inputs whole over dp": ((2, 2), ("dp", "tp"), {"shard": "dp"}),  # gradients whole over dp, not partial
    "dp, tp, checkpointed inside": ((2, 2), ("dp", "tp"), {"shard": "dp"}),
}
_MESHES = {}


def _spmd_mesh(kind):
    """One mesh object per shape and names in a process: a DTensor built on an equal mesh later may
    carry the first one (DTensor caches its specs), which torch's ``fully_shard`` then refuses as
    another mesh."""
    shape, names, _ = SPMD_MESHES[kind]
    if (shape, names) not in _MESHES:
        _MESHES[shape, names] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape, names]


def _spmd_trained(impl, kind):
    """The model's parameters distributed over the whole mesh (replicated over the data-parallel
    dims, the blocks' split over ``tp``), sharded by ``impl``'s ``fully_shard(dp_mesh_dims=...)``,
    trained 3 steps on inputs split over the data-parallel dims."""
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _spmd_mesh(kind)
    dims = (fsdp1.DataParallelMeshDims if impl == "fsdp1" else DataParallelMeshDims)(**SPMD_MESHES[kind][2])
    data_parallel = [Replicate()] * (mesh.ndim - 1)
    torch.manual_seed(0)
    model = SpmdModel(checkpointed=kind.endswith("checkpointed inside"))
    split = {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1)}
    for name, module in model.named_modules():
        for attr, param in list(module.named_parameters(recurse=False)):
            tp = split.get(f"{name.split('.')[-1]}.{attr}", Replicate()) if name.startswith("blocks") else Replicate()
            setattr(module, attr, nn.Parameter(distribute_tensor(param.detach(), mesh, [*data_parallel, tp])))
    shard = fully_shard_of(impl)
    for block in model.blocks:
        shard(block, mesh=mesh, dp_mesh_dims=dims)
    shard(model, mesh=mesh, dp_mesh_dims=dims)
    shown = placements_of(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    inputs = [Replicate() if kind.endswith("inputs whole over dp") else Shard(0)] * (mesh.ndim - 1) + [Replicate()]
    losses = []
    for step in range(3):
        x = distribute_tensor(torch.randn(8, DIM, generator=torch.Generator().manual_seed(step)), mesh, inputs)
        loss = (model(x) ** 2).mean().full_tensor()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return shown, losses, full_values(model)


def _spmd_same_as_torch(kind):
    return same_values(_spmd_trained("fsdp1", kind), _spmd_trained("torch", kind))


@pytest.mark.parametrize("kind", sorted(SPMD_MESHES))
def test_dp_mesh_dims_trains_as_torchs(kind):
    """Placements (the data-parallel split where ``Replicate()`` stood, several shard dims shown as
    their flattened one, nothing split over replicas only), losses and parameters."""
    world_size = 2 ** len(SPMD_MESHES[kind][0])
    assert run_on_ranks(world_size, _spmd_same_as_torch, kind) == [True] * world_size


def _dp_mesh_dims_refusal(impl, case):
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _spmd_mesh("dp, tp")
    dims = fsdp1.DataParallelMeshDims if impl == "fsdp1" else DataParallelMeshDims
    module = nn.Linear(4, 4)
    if case != "plain parameter":
        placements = [Shard(0), Replicate()] if case == "split over dp" else [Replicate(), Replicate()]
        for attr, param in list(module.named_parameters()):
            setattr(module, attr, nn.Parameter(distribute_tensor(param.detach(), mesh, placements)))
    given = {"unknown name": dims(shard="data")}.get(case, dims(shard="dp"))
    kwargs = {"reshard_after_forward": 2} if case == "int reshard_after_forward" else {}
    try:
        fully_shard_of(impl)(module, mesh=mesh, dp_mesh_dims=given, **kwargs)
    except Exception as error:  # noqa: BLE001 - compared with torch's
        return type(error).__name__, str(error).split(" fsdp1:")[0].rstrip(".")
    return "no error", ""


@pytest.mark.parametrize("case, kind", [("plain parameter", "ValueError"), ("split over dp", "ValueError"),
                                        ("unknown name", "ValueError"), ("int reshard_after_forward", "NotImplementedError")])
def test_dp_mesh_dims_refuses_what_torchs_refuses(case, kind):
    ours = run_on_ranks(4, _dp_mesh_dims_refusal, "fsdp1", case)[0]
    assert ours == run_on_ranks(4, _dp_mesh_dims_refusal, "torch", case)[0]
    assert ours[0] == kind


def _refused_tensor_parallel(impl, case):
    """What a build and its first step raise (torch's refuses some at the first forward)."""
    from torch.distributed.tensor import Partial, Shard, distribute_tensor

    mesh = _dp_tp_mesh()
    module = nn.Linear(4, 4)
    kwargs = {}
    if case == "partial placement":  # values that are not whole on any rank
        module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh["tp"], [Partial()]))
    else:
        kwargs["shard_placement_fn"] = lambda param: Shard(-3)
    try:
        model = fully_shard_of(impl)(module, mesh=mesh["dp"], **kwargs)
        model(torch.randn(2, 4)).sum().backward()
    except Exception as error:  # noqa: BLE001 - compared with torch's
        return type(error).__name__, str(error)
    return "no error", ""


@pytest.mark.parametrize("case", ["partial placement", "negative dim out of range"])
def test_what_torch_cannot_shard_is_refused_at_fully_shard(case):
    """A tensor-parallel parameter with a partial placement (torch's fails at the first forward; fsdp1
    trained it wrong) and a ``Shard`` dim below ``-ndim`` (fsdp1 raised an ``IndexError``)."""
    ours = run_on_ranks(4, _refused_tensor_parallel, "fsdp1", case)[0]
    theirs = run_on_ranks(4, _refused_tensor_parallel, "torch", case)[0]
    assert ours[0] == theirs[0]
    assert "fsdp1: " in ours[1]  # names the parameter and the fix
