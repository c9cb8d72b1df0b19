"""Tests ``fully_shard(shard_placement_fn=...)`` splitting parameters along dims other than 0
(``Shard(1)``, ``Shard(-1)``, the largest dim, as expert weights are sharded), against torch's
``fully_shard`` with the same function on 2 ranks: placements and local shapes, training bit for bit
(also in bf16 and kept gathered), state dicts, DCP checkpoints both ways and into a model sharded
along dim 0, and full values written back."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

import fsdp1

from _harness import run_on_ranks
from _models import adam, batch, fully_shard_of, lm_loss, make_gpt, same_values, shard_gpt, train_steps


def _even_dims(param):
    return [dim for dim in range(param.dim()) if param.shape[dim] % dist.get_world_size() == 0]


PLACEMENTS = {
    # the GPT's odd sizes leave some parameters on dim 0, as a policy over a real model does
    "dim 1": lambda p: Shard(1) if p.dim() == 2 and 1 in _even_dims(p) else None,
    "last dim": lambda p: Shard(-1) if p.dim() - 1 in _even_dims(p) else None,
    "largest dim": lambda p: Shard(max(_even_dims(p) or [0], key=lambda dim: p.shape[dim])),
}


def _sharded_gpt(impl, placement, **kwargs):
    return shard_gpt(make_gpt(), fully_shard_of(impl), shard_placement_fn=PLACEMENTS[placement], **kwargs)


def _mp_policy(impl):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = fsdp1.MixedPrecisionPolicy if impl == "fsdp1" else MixedPrecisionPolicy
    return policy(param_dtype=torch.bfloat16)


def _trained(impl, placement, variant):
    kwargs = {}
    if variant == "bf16":
        kwargs["mp_policy"] = _mp_policy(impl)
    if variant == "kept gathered":
        kwargs["reshard_after_forward"] = False
    model = _sharded_gpt(impl, placement, **kwargs)
    shown = [(name, [str(p) for p in param.placements], tuple(param.to_local().shape)) for name, param in model.named_parameters()]
    losses = train_steps(model, adam(model.parameters()), 0, 3)
    return shown, losses, [p.to_local().detach().clone() for p in model.parameters()]


def _same_as_torch(placement, variant):
    ours = _trained("fsdp1", placement, variant)
    return same_values(ours, _trained("torch", placement, variant)), ours[0]


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("variant", ["resharded", "bf16", "kept gathered"])
def test_parameters_sharded_along_other_dims_train_as_torchs(placement, variant):
    for same, shown in run_on_ranks(2, _same_as_torch, placement, variant):
        assert same
        assert any(placements != ["S(0)"] for _, placements, _ in shown)  # some parameter is split along another dim


def _state_dict(impl):
    model = _sharded_gpt(impl, "dim 1")
    return [(key, [str(p) for p in value.placements], value.to_local().clone()) for key, value in model.state_dict().items()]


def test_state_dict_is_torchs():
    """Keys, placements and local values of every entry."""
    assert same_values(run_on_ranks(2, _state_dict, "fsdp1"), run_on_ranks(2, _state_dict, "torch"))


def _dcp_round_trip(writer, reader, reader_placement, directory):
    """``writer`` trains a step with parameters split along dim 1 and saves model and optimizer with
    DCP; ``reader`` loads them with ``reader_placement``. Whether parameters and optimizer state are
    the writer's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _sharded_gpt(writer, "dim 1")
    optim = adam(model.parameters())
    lm_loss(model, *batch(0, dist.get_rank(), dist.get_world_size())).backward()
    optim.step()
    model_state, optim_state = get_state_dict(model, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    loaded = _sharded_gpt(reader, reader_placement)
    loaded_optim = adam(loaded.parameters())
    model_state, optim_state = get_state_dict(loaded, loaded_optim)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    set_state_dict(loaded, loaded_optim, model_state_dict=model_state, optim_state_dict=optim_state)
    dist.barrier()
    return same_values(_full_state(loaded, loaded_optim), _full_state(model, optim))


def _full_state(model, optim):
    """Every parameter's full value and full Adam state, in parameter order."""
    def full(value):
        return value.full_tensor().detach() if isinstance(value, DTensor) else value

    return [[full(p)] + [full(optim.state[p][key]) for key in ("step", "exp_avg", "exp_avg_sq")] for p in model.parameters()]


@pytest.mark.parametrize("writer,reader,reader_placement", [
    ("fsdp1", "torch", "dim 1"), ("torch", "fsdp1", "dim 1"), ("fsdp1", "fsdp1", "largest dim"),
])
def test_dcp_checkpoint_moves_between_fsdp1_and_torch_and_placements(writer, reader, reader_placement, tmp_path):
    assert run_on_ranks(2, _dcp_round_trip, writer, reader, reader_placement, str(tmp_path)) == [True, True]


def _written_back():
    """Full values assigned inside ``summon_full_params`` land in each rank's columns."""
    model = _sharded_gpt("fsdp1", "dim 1")
    expected = {}
    with model.summon_full_params(writeback=True):
        for name, param in model.named_parameters():
            with torch.no_grad():
                param.copy_(torch.arange(param.numel(), dtype=param.dtype).view(param.shape))
            expected[name] = param.detach().clone()
    return all(torch.equal(param.full_tensor(), expected[name]) for name, param in model.named_parameters())


def test_full_values_written_back_land_in_each_ranks_slices():
    assert run_on_ranks(2, _written_back) == [True, True]


def _loaded_from_full_values():
    """A state dict of plain full tensors (fsdp1 takes them; each rank keeps its slices)."""
    source = make_gpt(seed=3)
    model = _sharded_gpt("fsdp1", "dim 1")
    model.load_state_dict(source.state_dict())
    return all(torch.equal(param.full_tensor(), source.state_dict()[name]) for name, param in model.named_parameters())


def test_a_state_dict_of_full_tensors_loads_into_each_ranks_slices():
    assert run_on_ranks(2, _loaded_from_full_values) == [True, True]
