"""Tests what torch 2.15 added to ``fully_shard``, which fsdp1 offers on every release: manual backward
finalization (``set_manual_backward_finalization``, ``finalize_backward``, ``GradientReductionHandle``),
``set_keep_unsharded_storage``, ``MixedPrecisionPolicy.param_dtype_override_fn``; and the default
reduction dtype, which 2.15 changed (``reduce_dtype=None`` with ``param_dtype`` set reduces in the
parameter's dtype from 2.15 on, in ``param_dtype`` before). Each against torch's own ``fully_shard``
where the release has the feature, and against DDP or an exact expected value where it does not."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp1

from _harness import run_on_ranks
from _models import adam, batch, full_grads, fully_shard_of, lm_loss, make_gpt, run_both, same_tensors, shard_gpt, train_steps

TORCH_HAS_2_15_API = fsdp1._torch_version.release(torch.__version__) >= (2, 15)
IMPLS = ("fsdp1", "torch") if TORCH_HAS_2_15_API else ("fsdp1",)


def _api(impl):
    """fsdp1, or torch's ``torch.distributed.fsdp``."""
    if impl == "fsdp1":
        return fsdp1
    from torch.distributed import fsdp

    return fsdp


def _results(body, *args):
    """Rank 0's result of ``body(impl, *args)`` for fsdp1 and, where the release has the API, torch."""
    if TORCH_HAS_2_15_API:
        return run_both(body, *args)
    return (run_on_ranks(2, body, "fsdp1", *args)[0],)


# ---------------------------------------------------------------------------------------------- manual finalization
def _accumulated_with_manual_finalization(impl):
    """Two steps of two micro-batches, synchronisation off for both backwards and on again before the
    caller's finalization; the second step finalizes asynchronously. DDP does the same accumulation."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if impl == "ddp":
        model = DDP(make_gpt())
    else:
        model = shard_gpt(make_gpt(), fully_shard_of(impl))
        model.set_manual_backward_finalization(True)
        assert model.finalize_backward() is None  # before the first forward: nothing to finalize
    optim = adam(model.parameters())
    losses, grads = [], []
    for step in range(2):
        for micro in range(2):
            loss = lm_loss(model, *batch(2 * step + micro, rank, world))
            if impl == "ddp" and micro == 0:
                with model.no_sync():
                    loss.backward()
            elif impl == "ddp":
                loss.backward()
            else:
                model.set_requires_gradient_sync(False)
                loss.backward()
            losses.append(loss.item())
        if impl != "ddp":
            model.set_requires_gradient_sync(True)
            handle = model.finalize_backward(async_op=step == 1)
            if step == 1:
                assert isinstance(handle, _api(impl).GradientReductionHandle)
                handle.wait()
        grads.append([p.grad.full_tensor() if impl != "ddp" else p.grad.clone() for p in model.parameters()])
        optim.step()
        optim.zero_grad()
    return losses, grads


def test_manual_finalization_reduces_what_unsynchronised_backwards_left_as_torchs_and_ddp():
    """Bitwise torch's where the release has it; DDP's to rounding."""
    ddp_losses, ddp_grads = run_on_ranks(2, _accumulated_with_manual_finalization, "ddp")[0]
    results = _results(_accumulated_with_manual_finalization)
    ours_losses, ours_grads = results[0]
    if len(results) == 2:
        assert results[0][0] == results[1][0]
        assert all(same_tensors(a, b) for a, b in zip(results[0][1], results[1][1]))
    assert max(abs(a - b) for a, b in zip(ours_losses, ddp_losses)) < 1e-5
    assert max((a - b).abs().max().item() for step_a, step_b in zip(ours_grads, ddp_grads)
               for a, b in zip(step_a, step_b)) < 1e-5


def _outcome(call):
    try:
        result = call()
    except Exception as error:  # noqa: BLE001 - the outcome is compared with torch's
        return type(error).__name__, str(error).split(". fsdp1:")[0]
    return type(result).__name__


def _misuses_of_manual_finalization(impl):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard_gpt(make_gpt(), fully_shard_of(impl))
    outcomes = []
    lm_loss(model, *batch(0, rank, world)).backward()
    outcomes.append(_outcome(model.finalize_backward))  # not in manual mode
    outcomes.append(_outcome(lambda: model.blocks[0].set_manual_backward_finalization(True)))  # not the root
    model.set_manual_backward_finalization(True)
    lm_loss(model, *batch(1, rank, world)).backward()
    outcomes.append(_outcome(lambda: model.set_manual_backward_finalization(False)))  # a backward awaits finalization
    outcomes.append(_outcome(model.blocks[0].finalize_backward))  # not the root
    handle = model.finalize_backward(async_op=True)
    outcomes.append(_outcome(model.finalize_backward))  # the handle was not waited on
    outcomes.append(_outcome(lambda: model(batch(2, rank, world)[0])))  # nor before a forward
    handle.wait()
    lm_loss(model, *batch(2, rank, world)).backward()
    handle = model.finalize_backward(async_op=True)
    model.reset_iter_state()
    outcomes.append(_outcome(handle.wait))  # reset dropped it
    model.set_manual_backward_finalization(False)
    loss = lm_loss(model, *batch(3, rank, world))
    loss.backward()
    outcomes.append(all(p.grad is not None for p in model.parameters()))  # automatic again
    return outcomes


def test_misuses_of_manual_finalization_raise_torchs_errors():
    results = _results(_misuses_of_manual_finalization)
    assert results[0] == [
        ("RuntimeError", "FSDP finalize_backward requires manual backward finalization. Call "
                         "set_manual_backward_finalization(True) before forward"),
        ("RuntimeError", "set_manual_backward_finalization must be called on the root FSDP module"),
        ("RuntimeError", "set_manual_backward_finalization cannot change mode after backward starts"),
        ("RuntimeError", "finalize_backward must be called on the root FSDP module"),
        ("RuntimeError", "The previous gradient reduction must be waited on before finalizing backward again"),
        ("RuntimeError", "The previous gradient reduction must be waited on before forward"),
        ("RuntimeError", "This gradient reduction handle was invalidated"),
        True,
    ]
    if len(results) == 2:
        assert results[1] == results[0]


# ---------------------------------------------------------------------------------------------- kept storage
def _kept_unsharded_storage(impl, keep):
    model = shard_gpt(make_gpt(), fully_shard_of(impl))
    if keep:
        model.set_keep_unsharded_storage(True)
    losses = train_steps(model, adam(model.parameters()), 0, 3)
    block = model.blocks[0]
    addresses = []
    for _ in range(2):
        block.unshard()
        addresses.append(block.fc.weight.data_ptr())
        block.reshard()
    return losses, [p.to_local().detach().clone() for p in model.parameters()], keep and addresses[0] == addresses[1]


def test_kept_unsharded_storage_keeps_its_address_and_trains_the_same_numbers():
    for impl in IMPLS:
        kept_losses, kept_params, same_address = run_on_ranks(2, _kept_unsharded_storage, impl, True)[0]
        losses, params, _ = run_on_ranks(2, _kept_unsharded_storage, impl, False)[0]
        assert same_address, impl
        assert kept_losses == losses and same_tensors(kept_params, params), impl


# ---------------------------------------------------------------------------------------------- mixed precision
def _norms_kept_in_float32(impl):
    """Every block's norms keep float32 through ``param_dtype_override_fn`` (in groups of their own, as
    fsdp1's groups are one dtype each), the rest computes in bfloat16."""
    shard = fully_shard_of(impl)
    policy = _api(impl).MixedPrecisionPolicy
    keep = policy(param_dtype=torch.bfloat16, param_dtype_override_fn=lambda param: param.dtype)
    model = make_gpt()
    seen = []
    for block in model.blocks:
        shard([block.ln1, block.ln2], mp_policy=keep)
        block.ln1.register_forward_hook(lambda module, args, out: seen.append((module.weight.dtype, out.dtype)))
    shard_gpt(model, shard, mp_policy=policy(param_dtype=torch.bfloat16))
    losses = train_steps(model, adam(model.parameters()), 0, 2)
    return losses, [p.to_local().detach().clone() for p in model.parameters()], sorted(set(seen), key=str)


def test_param_dtype_override_keeps_the_norms_in_their_dtype_as_torchs():
    results = _results(_norms_kept_in_float32)
    assert {weight for weight, _ in results[0][2]} == {torch.float32}  # the norms' weights inside their forward
    if len(results) == 2:
        assert results[0][0] == results[1][0] and same_tensors(results[0][1], results[1][1])


def _refused_overrides(impl):
    outcomes = []
    for override in (lambda p: "float32", lambda p: torch.float16, lambda p: p.dtype if p.ndim == 1 else None):
        policy = _api(impl).MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=override)
        outcomes.append(_outcome(lambda: fully_shard_of(impl)(make_gpt().blocks[0], mp_policy=policy)))
    return outcomes


def test_param_dtype_override_refuses_what_torch_refuses_and_one_group_of_two_dtypes():
    results = _results(_refused_overrides)
    assert results[0] == [
        ("ValueError", "param_dtype_override_fn must return a torch.dtype or None but got <class 'str'>"),
        ("ValueError", "param_dtype_override_fn must return None, param_dtype, or the parameter's original dtype but "
                       "got torch.float16 for a parameter with dtype torch.float32 and param_dtype torch.bfloat16"),
        ("NotImplementedError", "fsdp1: param_dtype_override_fn gives one fully_shard group several compute dtypes "
                                "('ln1.weight' in torch.float32, 'qkv.weight' in torch.bfloat16); a group gathers into "
                                "one flat buffer of one dtype. Call fully_shard on the modules whose parameters keep "
                                "their own dtype first, as groups of their own."),
    ]
    if len(results) == 2:
        assert results[1][:2] == results[0][:2] and results[1][2] == "FSDPBlock"  # torch's gathers two dtypes


def _default_reduce_dtype(impl, reduce_dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    policy = _api(impl).MixedPrecisionPolicy
    model = shard_gpt(make_gpt(), fully_shard_of(impl), mp_policy=policy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype))
    lm_loss(model, *batch(0, rank, world)).backward()
    return full_grads(model)


def test_reduce_dtype_none_reduces_as_this_releases_fully_shard():
    """Bitwise torch's on every release; from 2.15 on that is the float32 reduction, before it bfloat16's."""
    ours, theirs = run_both(_default_reduce_dtype, None)
    assert same_tensors(ours, theirs)
    expected = torch.float32 if fsdp1._torch_version.release(torch.__version__) >= (2, 15) else torch.bfloat16
    assert same_tensors(ours, run_on_ranks(2, _default_reduce_dtype, "fsdp1", expected)[0])
