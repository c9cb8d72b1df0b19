"""Tests Lightning Fabric's ``FSDPStrategy`` driving fsdp1 under ``fsdp1.use_as_torch_fsdp``,
through the strategy's own methods: ``setup_module`` (``auto_wrap_policy={Block}``, with and without
``activation_checkpointing_policy={Block}``), ``setup_optimizer``, ``backward`` (also under
``no_backward_sync``), ``clip_gradients_norm``, ``optimizer_step``, ``save_checkpoint`` and
``load_checkpoint`` ('full' and 'sharded'). Fabric builds fsdp1's units with clean state-dict keys;
its training equals torch's FSDP1 driven by the same strategy bit for bit (losses, gradient norms,
final parameters); a run resumed from its checkpoint equals the uninterrupted run bit for bit, and
torch's FSDP1 resumes the same from fsdp1's sharded checkpoint.

What of Fabric cannot run here, and why:
- ``Fabric(accelerator="cpu", strategy="fsdp")``: its connector refuses ("FSDP is only available on
  GPU"), so the strategy is built directly, with a CPU accelerator and an environment whose ranks
  are those of the gloo group the pool already started (``setup_environment`` then keeps that group).
- torch's FSDP1 exactly as Fabric constructs it: the strategy passes ``device_id=root_device.index``,
  None for a CPU device, and torch's FSDP1 then refuses the CPU module ("FSDP needs a non-CPU
  accelerator device"). The oracle is torch's class with ``device_id=cpu`` filled in.
- torch's FSDP1 under a 'full' checkpoint: Fabric saves it with ``rank0_only`` and ``offload_to_cpu``,
  which crashes torch's FSDP1 on CPU ("setStorage ... storage of size 0"), so 'full' is checked
  against the uninterrupted run only.
"""

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import fsdp1

from _harness import run_on_ranks
from _models import Block, adam, batch, lm_loss, make_gpt

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

MAX_NORM = 0.7
"""Between the gradient norms of different steps, so that clipping both acts and leaves alone."""


@contextlib.contextmanager
def _torch_fsdp1_on_cpu():
    """torch's FSDP1 at its import paths, with the ``device_id=cpu`` it needs on CPU."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    class TorchFSDPOnCPU(TorchFSDP):
        def __init__(self, *args, device_id=None, **kwargs):
            super().__init__(*args, device_id=torch.device("cpu"), **kwargs)

    with mock.patch("torch.distributed.fsdp.FullyShardedDataParallel", TorchFSDPOnCPU), \
            mock.patch("torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel", TorchFSDPOnCPU):
        yield


def _implementation(name):
    return fsdp1.use_as_torch_fsdp() if name == "fsdp1" else _torch_fsdp1_on_cpu()


def _strategy(**kwargs):
    """Fabric's FSDPStrategy on this rank's CPU, set up in the pool's gloo group."""
    from lightning.fabric.accelerators import CPUAccelerator
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.plugins.precision.fsdp import FSDPPrecision
    from lightning.fabric.strategies import FSDPStrategy

    class PoolEnvironment(LightningEnvironment):
        def local_rank(self) -> int:
            return dist.get_rank()

    strategy = FSDPStrategy(accelerator=CPUAccelerator(), parallel_devices=[torch.device("cpu")] * dist.get_world_size(),
                            cluster_environment=PoolEnvironment(), precision=FSDPPrecision("32-true"),
                            auto_wrap_policy={Block}, **kwargs)
    strategy.setup_environment()
    return strategy


def _setup(strategy, seed):
    model = strategy.setup_module(make_gpt(seed))
    return model, strategy.setup_optimizer(adam(model.parameters()))


def _fabric_steps(strategy, model, optim, first, count):
    """Steps ``first`` to ``first + count - 1`` as Fabric's loop makes them; each step's loss and
    gradient norm before clipping."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for step in range(first, first + count):
        loss = lm_loss(model, *batch(step, rank, world))
        strategy.backward(loss, model)
        norm = strategy.clip_gradients_norm(model, optim, max_norm=MAX_NORM)
        strategy.optimizer_step(optim)
        optim.zero_grad()
        results.append((loss.item(), norm.item()))
    return results


def _fabric_accumulated_step(strategy, model, optim, step):
    """One step over two micro-batches, the first without gradient synchronisation (Fabric's
    ``no_backward_sync``); the losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with strategy._backward_sync_control.no_backward_sync(model, enabled=True):
        first = lm_loss(model, *batch(step, rank, world))
        strategy.backward(first, model)
    second = lm_loss(model, *batch(step + 1, rank, world))
    strategy.backward(second, model)
    strategy.optimizer_step(optim)
    optim.zero_grad()
    return first.item(), second.item()


def _fabric_training(implementation, use_orig_params, activation_checkpointing):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    with _implementation(implementation):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        strategy = _strategy(use_orig_params=use_orig_params,
                             activation_checkpointing_policy={Block} if activation_checkpointing else None)
        model, optim = _setup(strategy, seed=0)
        steps = _fabric_steps(strategy, model, optim, 0, 4)
        accumulated = _fabric_accumulated_step(strategy, model, optim, 4)
        units = [type(module).__module__ for module in model.modules() if isinstance(module, FSDP)]
        checkpointed = sum(isinstance(module, CheckpointWrapper) for module in model.modules())
        return steps, accumulated, model.state_dict(), units, checkpointed


def _assert_trains_as_torch_fsdp1(use_orig_params, activation_checkpointing):
    ours = run_on_ranks(2, _fabric_training, "fsdp1", use_orig_params, activation_checkpointing)
    theirs = run_on_ranks(2, _fabric_training, "torch", use_orig_params, activation_checkpointing)
    plain_keys = list(make_gpt().state_dict())
    for (steps, accumulated, state, units, checkpointed), (their_steps, their_accumulated, their_state, _,
                                                          their_checkpointed) in zip(ours, theirs):
        assert units == ["fsdp1._wrapper.fully_sharded_data_parallel"] * 3
        assert checkpointed == their_checkpointed == (2 if activation_checkpointing else 0)
        assert steps == their_steps
        assert accumulated == their_accumulated
        assert min(norm for _, norm in steps) < MAX_NORM < max(norm for _, norm in steps)
        assert list(state) == list(their_state) == plain_keys
        assert all(torch.equal(state[key], their_state[key]) for key in plain_keys)


@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_fabric_trains_fsdp1_units_as_it_trains_torch_fsdp1(activation_checkpointing):
    pytest.importorskip("lightning")
    _assert_trains_as_torch_fsdp1(True, activation_checkpointing)


def _fabric_save_and_resume(state_dict_type, use_orig_params, path):
    with fsdp1.use_as_torch_fsdp():
        strategy = _strategy(state_dict_type=state_dict_type, use_orig_params=use_orig_params)
        model, optim = _setup(strategy, seed=0)
        _fabric_steps(strategy, model, optim, 0, 3)
        strategy.save_checkpoint(path, {"model": model, "optimizer": optim, "step": 3})
        uninterrupted = _fabric_steps(strategy, model, optim, 3, 3), model.state_dict()
        resumed_model, resumed_optim = _setup(strategy, seed=7)
        state = {"model": resumed_model, "optimizer": resumed_optim, "step": 0}
        strategy.load_checkpoint(path, state)
        resumed = _fabric_steps(strategy, resumed_model, resumed_optim, 3, 3), resumed_model.state_dict()
    return uninterrupted, resumed, state["step"]


def _saved_names(path, state_dict_type):
    """The parameter names under 'model' and under the optimizer's state in Fabric's checkpoint."""
    if state_dict_type == "full":
        checkpoint = torch.load(path)
        return set(checkpoint["model"]), set(checkpoint["optimizer"]["state"])
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(path).read_metadata().state_dict_metadata
    model = {key[len("model."):] for key in keys if key.startswith("model.")}
    optimizer = {key[len("optimizer.state."):].rsplit(".", 1)[0] for key in keys if key.startswith("optimizer.state.")}
    return model, optimizer


def _assert_resumes_bitwise(state_dict_type, use_orig_params, path):
    """Returns each rank's uninterrupted run (steps and final state)."""
    results = run_on_ranks(2, _fabric_save_and_resume, state_dict_type, use_orig_params, path)
    for (uninterrupted, uninterrupted_state), (resumed, resumed_state), step in results:
        assert resumed == uninterrupted
        assert step == 3
        assert all(torch.equal(resumed_state[key], value) for key, value in uninterrupted_state.items())
    plain_keys = set(make_gpt().state_dict())
    assert _saved_names(path, state_dict_type) == (plain_keys, plain_keys)
    return [uninterrupted for uninterrupted, _, _ in results]


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_fabric_checkpoint_resumes_fsdp1_bitwise(state_dict_type, tmp_path):
    pytest.importorskip("lightning")
    _assert_resumes_bitwise(state_dict_type, True, str(tmp_path / "checkpoint"))


def _torch_fsdp1_resume(use_orig_params, path):
    with _torch_fsdp1_on_cpu():
        strategy = _strategy(state_dict_type="sharded", use_orig_params=use_orig_params)
        model, optim = _setup(strategy, seed=7)
        state = {"model": model, "optimizer": optim, "step": 0}
        strategy.load_checkpoint(path, state)
        return _fabric_steps(strategy, model, optim, 3, 3), model.state_dict()


def _assert_torch_fsdp1_resumes_from_sharded_checkpoint_of_fsdp1(use_orig_params, path):
    ours = _assert_resumes_bitwise("sharded", use_orig_params, path)
    theirs = run_on_ranks(2, _torch_fsdp1_resume, use_orig_params, path)
    for (uninterrupted, uninterrupted_state), (resumed, resumed_state) in zip(ours, theirs):
        assert resumed == uninterrupted
        assert all(torch.equal(resumed_state[key], value) for key, value in uninterrupted_state.items())


def test_torch_fsdp1_resumes_from_fabrics_sharded_checkpoint_of_fsdp1(tmp_path):
    pytest.importorskip("lightning")
    _assert_torch_fsdp1_resumes_from_sharded_checkpoint_of_fsdp1(True, str(tmp_path / "checkpoint"))


def test_fabric_trains_and_resumes_fsdp1_without_orig_params(tmp_path):
    """Everything above with use_orig_params=False (Fabric's setup_optimizer then looks for torch's
    ``_fsdp_flattened`` marker on the flat parameter)."""
    pytest.importorskip("lightning")
    _assert_trains_as_torch_fsdp1(False, True)
    _assert_resumes_bitwise("full", False, str(tmp_path / "full"))
    _assert_torch_fsdp1_resumes_from_sharded_checkpoint_of_fsdp1(False, str(tmp_path / "sharded"))
