"""Tests ``fsdp1.checkpoint`` (docs/reliability.md, cases C1–C14):
a checkpoint is committed (its manifest written last, after every rank wrote its part) or it is not
one; a committed one is never written into, and every file is checked against the manifest before
anything is loaded, so a truncated or bit-flipped file is an error naming it on every rank instead
of silently different weights (DCP alone loads those). Every error is an ``Exception``."""

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fsdp1

from _harness import run_on_ranks
from _jobs import failed, run_job
from _models import adam, make_gpt, train_steps, wrap_fsdp1

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _state(model, optim):
    with fsdp1.FullyShardedDataParallel.state_dict_type(model, fsdp1.StateDictType.SHARDED_STATE_DICT):
        return {"model": model.state_dict(), "optim": fsdp1.FullyShardedDataParallel.optim_state_dict(model, optim)}


def _full(model):
    with fsdp1.FullyShardedDataParallel.summon_full_params(model):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def _trained(seed=0, steps=2):
    model = wrap_fsdp1(make_gpt(seed=seed))
    optim = adam(model.parameters())
    train_steps(model, optim, 0, steps)
    return model, optim


def _resume(model, optim, path):
    """Load the checkpoint at ``path`` into ``model`` and ``optim``, as a training script resumes."""
    from fsdp1 import checkpoint

    state = _state(model, optim)
    checkpoint.load(state, path)
    with fsdp1.FullyShardedDataParallel.state_dict_type(model, fsdp1.StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(state["model"])
        optim.load_state_dict(fsdp1.FullyShardedDataParallel.optim_state_dict_to_load(model, optim, state["optim"]))


def _load_into_fresh(path):
    model, optim = _trained(seed=7, steps=0)
    _resume(model, optim, path)
    return model


def _error_of(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return type(error).__name__, str(error)
    return None


def _round_trip_and_refusals(root):
    from fsdp1 import checkpoint

    model, optim = _trained()
    first = Path(root) / "step_000002"
    checkpoint.save(_state(model, optim), first)
    saved = _full(model)
    again = _error_of(lambda: checkpoint.save(_state(model, optim), first))
    loaded = _full(_load_into_fresh(first))
    dist.barrier()
    if dist.get_rank() == 0:  # another job's save in flight
        (Path(root) / "step_000004.lock").write_text("host elsewhere pid 4242")
    dist.barrier()
    busy = _error_of(lambda: checkpoint.save(_state(model, optim), Path(root) / "step_000004"))
    return (all(torch.equal(saved[k], loaded[k]) for k in saved), again, busy, checkpoint.is_committed(first),
            sorted(p.name for p in Path(root).iterdir()))


def test_a_committed_checkpoint_loads_bitwise_and_is_never_written_into_or_saved_twice(tmp_path):
    for equal, again, busy, committed, names in run_on_ranks(2, _round_trip_and_refusals, str(tmp_path)):
        assert equal
        assert committed
        assert again[0] == "CheckpointExists"
        assert "already holds a committed checkpoint" in again[1]
        assert busy[0] == "CheckpointBusy"
        assert "host elsewhere pid 4242" in busy[1]
        assert names == ["step_000002", "step_000004.lock"]  # no staging left, the other job's lock kept


@contextlib.contextmanager
def _disk_full_on_rank_1():
    """DCP's file writer raises ENOSPC on rank 1 within."""
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def full_disk(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device")
        return original(self, plan, planner)

    FileSystemWriter.write_data = full_disk
    try:
        yield
    finally:
        FileSystemWriter.write_data = original


def _failing_writer_on_rank_1(root):
    from fsdp1 import checkpoint

    model, optim = _trained()
    good = Path(root) / "step_000002"
    checkpoint.save(_state(model, optim), good)
    saved = _full(model)
    train_steps(model, optim, 2, 1)
    with _disk_full_on_rank_1():
        error = _error_of(lambda: checkpoint.save(_state(model, optim), Path(root) / "step_000003"))
    alive = torch.ones(1)
    dist.all_reduce(alive)  # the process group still works
    names = sorted(p.name for p in Path(root).iterdir())
    latest = checkpoint.latest(root).name
    checkpoint.save(_state(model, optim), Path(root) / "step_000003")  # the lock was released
    loaded = _full(_load_into_fresh(good))
    return error, alive.item(), names, latest, all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_a_save_that_fails_on_one_rank_raises_on_every_rank_and_commits_nothing(tmp_path):
    """Case C4: ENOSPC on rank 1."""
    for (kind, message), alive, names, latest, intact in run_on_ranks(2, _failing_writer_on_rank_1, str(tmp_path)):
        assert kind == "CheckpointError"
        assert "rank(s) [1]" in message
        assert "No space left on device" in message
        assert alive == 2.0
        assert names == ["step_000002"]
        assert latest == "step_000002"
        assert intact


def _corrupted(root, damage):
    from fsdp1 import checkpoint

    model, optim = _trained()
    path = Path(root) / "step_000002"
    checkpoint.save(_state(model, optim), path)
    dist.barrier()
    if dist.get_rank() == 0:
        if damage == "manifest":
            (path / checkpoint.MANIFEST).write_text((path / checkpoint.MANIFEST).read_text()[:-9])
        else:
            victim = path / ("__1_0.distcp" if damage != "metadata" else ".metadata")
            data = bytearray(victim.read_bytes())
            if damage == "truncated":
                data = data[: len(data) // 2]
            else:
                data[len(data) * 2 // 3] ^= 0x10  # one bit
            victim.write_bytes(bytes(data))
    dist.barrier()
    fresh, fresh_optim = _trained(seed=7, steps=0)
    before = _full(fresh)
    error = _error_of(lambda: checkpoint.load(_state(fresh, fresh_optim), path))
    after = _full(fresh)
    return error, all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("damage, named", [
    ("truncated", "file __1_0.distcp has"),  # C5
    ("bit flip", "file __1_0.distcp has CRC-32"),  # C6
    ("metadata", "file .metadata has CRC-32"),  # C7
    ("manifest", "fsdp1_manifest.json is unreadable"),  # C7, the marker itself
])
def test_a_damaged_checkpoint_is_refused_on_every_rank_naming_the_file(damage, named, tmp_path):
    for (kind, message), untouched in run_on_ranks(2, _corrupted, str(tmp_path), damage):
        assert kind == "CheckpointCorrupted"
        assert named in message
        assert untouched
        if damage == "truncated":
            assert "bytes, the manifest recorded" in message


def _pruned(root):
    from fsdp1 import checkpoint

    assert checkpoint.prune(Path(root) / "not yet made", keep=1) == []  # a fresh run prunes before its first save
    model, optim = _trained()
    for step in (2, 4, 6):
        checkpoint.save(_state(model, optim), Path(root) / f"step_{step:06d}")
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(root) / "step_000008.partial-0123456789ab").mkdir()  # a save that died
    dist.barrier()
    before = checkpoint.latest(root).name
    removed = sorted(p.name for p in checkpoint.prune(root, keep=2))
    return before, removed, [p.name for p in checkpoint.committed(root)]


def test_prune_keeps_the_latest_committed_and_removes_dead_staging(tmp_path):
    for before, removed, left in run_on_ranks(2, _pruned, str(tmp_path)):
        assert before == "step_000006"
        assert removed == ["step_000002", "step_000008.partial-0123456789ab"]
        assert left == ["step_000004", "step_000006"]


JOB_STARTED = '''
from fsdp1 import checkpoint
from _models import adam, make_gpt, train_steps, wrap_fsdp1
model = wrap_fsdp1(make_gpt()); optim = adam(model.parameters())
def state():
    with fsdp1.FullyShardedDataParallel.state_dict_type(model, fsdp1.StateDictType.SHARDED_STATE_DICT):
        return {{"model": model.state_dict(), "optim": fsdp1.FullyShardedDataParallel.optim_state_dict(model, optim)}}
train_steps(model, optim, 0, 1)
checkpoint.save(state(), {root!r} + "/step_000001")
train_steps(model, optim, 1, 1)
'''  # two steps trained, the first committed as step_000001

JOB = JOB_STARTED + '''from torch.distributed.checkpoint import FileSystemWriter
original = FileSystemWriter.write_data
def write_then_die(self, plan, planner):
    written = original(self, plan, planner)
    written.wait()
    if dist.get_rank() == 1:
        os._exit(17)  # killed after writing its data, before the commit
    return written
FileSystemWriter.write_data = write_then_die
checkpoint.save(state(), {root!r} + "/step_000002")
'''


def _killed_job(template, tmp_path):
    """Run the job ``template`` (checkpoints under ``tmp_path/ckpt``) on 2 plain processes, one of which
    dies: the other must fail too, and nothing may hang or outlive the job."""
    job = run_job(tmp_path, template.format(root=str(tmp_path / "ckpt")), torchrun=False)
    assert not failed(job), (failed(job), job.output[-2000:])
    assert all(code != 0 for code in job.returncodes), (failed(job), job.output[-2000:])


def test_a_rank_killed_during_a_save_leaves_the_last_committed_checkpoint_latest(tmp_path):
    """Case C1: the job fails, the second save is not a checkpoint, the first is latest."""
    from fsdp1 import checkpoint

    _killed_job(JOB, tmp_path)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "step_000002" not in names
    assert any(name.startswith("step_000002.partial-") for name in names)
    assert checkpoint.latest(tmp_path / "ckpt").name == "step_000001"
    assert checkpoint.verify(tmp_path / "ckpt" / "step_000001")
    with pytest.raises(checkpoint.CheckpointIncomplete, match="no such directory"):
        checkpoint.verify(tmp_path / "ckpt" / "step_000002")
    staged = next(p for p in (tmp_path / "ckpt").iterdir() if ".partial-" in p.name)
    with pytest.raises(checkpoint.CheckpointIncomplete, match="not a committed checkpoint"):
        checkpoint.verify(staged)


def test_every_checkpoint_error_is_an_exception():
    """Case C13: DCP's own is a BaseException, which `except Exception` misses."""
    from fsdp1 import checkpoint

    for error in (checkpoint.CheckpointError, checkpoint.CheckpointIncomplete, checkpoint.CheckpointCorrupted,
                  checkpoint.CheckpointExists, checkpoint.CheckpointBusy):
        assert issubclass(error, Exception)


class TinyHead(torch.nn.Module):
    """A head with fewer rows than ranks (``Linear(d, 1)``): one rank holds none of its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = torch.nn.Linear(6, 6), torch.nn.Linear(6, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _tiny_head_resume(root, use_orig_params):
    from fsdp1 import checkpoint

    def build(seed):
        torch.manual_seed(seed)
        model = fsdp1.FullyShardedDataParallel(TinyHead(), use_orig_params=use_orig_params,
                                               auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({torch.nn.Linear}))
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def steps(model, optim, first, count):
        losses = []
        for step in range(first, first + count):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            loss = model(x).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        return losses

    model, optim = build(0)
    steps(model, optim, 0, 2)
    checkpoint.save(_state(model, optim), Path(root) / "step_000002")
    uninterrupted = steps(model, optim, 2, 3)
    fresh, fresh_optim = build(5)
    _resume(fresh, fresh_optim, Path(root) / "step_000002")
    return uninterrupted, steps(fresh, fresh_optim, 2, 3)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_a_parameter_with_fewer_rows_than_ranks_resumes_bitwise(use_orig_params, tmp_path):
    """Case C10 (torch's FSDP1 fails there: "Missing key in checkpoint state_dict:
    optim.param_groups")."""
    for uninterrupted, resumed in run_on_ranks(2, _tiny_head_resume, str(tmp_path), use_orig_params):
        assert resumed == uninterrupted


def _into_a_wider_model(root):
    from fsdp1 import checkpoint

    def build(width):
        torch.manual_seed(0)
        model = fsdp1.FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2)),
                                               auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({torch.nn.Linear}))
        return model, torch.optim.Adam(model.parameters())

    model, optim = build(8)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    checkpoint.save(_state(model, optim), Path(root) / "step_000001")
    wider, wider_optim = build(12)
    return _error_of(lambda: checkpoint.load(_state(wider, wider_optim), Path(root) / "step_000001"))


def test_loading_into_another_model_names_the_key_and_both_shapes_on_every_rank(tmp_path):
    """Case C8."""
    for kind, message in run_on_ranks(2, _into_a_wider_model, str(tmp_path)):
        assert kind == "CheckpointError"
        assert "rank(s) [0, 1]" in message
        assert "saved torch.Size([8, 4]) and current: torch.Size([12, 4]) for model.0.weight" in message


def _stale_lock(root):
    """A lock left by a process of this host that is gone (a save killed, the job restarted)."""
    import socket

    from fsdp1 import checkpoint

    model, optim = _trained()
    target = Path(root) / "step_000002"
    if dist.get_rank() == 0:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        target.with_name("step_000002.lock").write_text(f"host {socket.gethostname()} pid {dead.stdout.strip()}")
    dist.barrier()
    checkpoint.save(_state(model, optim), target)
    dist.barrier()  # rank 0 releases the lock as its save returns, which may be after rank 1's
    return checkpoint.is_committed(target), sorted(p.name for p in Path(root).iterdir())


def test_a_lock_left_by_a_dead_process_of_this_host_is_taken_over(tmp_path):
    for committed, names in run_on_ranks(2, _stale_lock, str(tmp_path)):
        assert committed
        assert names == ["step_000002"]


def _small(seed):
    """A small MLP with Adam (odd sizes, so shards split rows unevenly at 3 and 4 ranks)."""
    torch.manual_seed(seed)
    model = fsdp1.FullyShardedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3)),
        auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({torch.nn.Linear}))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _save_for_resharding(root):
    from fsdp1 import checkpoint

    model, optim = _small(0)
    for step in range(2):
        torch.manual_seed(step)
        model(torch.randn(4, 6)).square().mean().backward()
        optim.step()
        optim.zero_grad()
    checkpoint.save(_state(model, optim), Path(root) / "step_000002")
    return _full(model), _full_optim(model, optim)


def _full_optim(model, optim):
    with fsdp1.FullyShardedDataParallel.state_dict_type(model, fsdp1.StateDictType.FULL_STATE_DICT):
        state = fsdp1.FullyShardedDataParallel.optim_state_dict(model, optim)["state"]
    return {(fqn, name): value.clone() for fqn, entry in state.items() for name, value in entry.items()
            if torch.is_tensor(value)}


def _load_resharded(root):
    model, optim = _small(7)
    _resume(model, optim, Path(root) / "step_000002")
    return _full(model), _full_optim(model, optim)


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_a_checkpoint_saved_on_2_ranks_loads_bitwise_on_another_number(world_size, tmp_path):
    """Case C9: model and Adam state saved at 2 ranks, loaded at 1, 3 and 4."""
    saved_params, saved_optim = run_on_ranks(2, _save_for_resharding, str(tmp_path))[0]
    for params, optim_state in run_on_ranks(world_size, _load_resharded, str(tmp_path)):
        assert params.keys() == saved_params.keys()
        assert optim_state.keys() == saved_optim.keys()
        assert all(torch.equal(params[k], saved_params[k]) for k in params)
        assert all(torch.equal(optim_state[k], saved_optim[k]) for k in optim_state)


def _non_finite(root):
    from fsdp1 import checkpoint

    model, optim = _trained()
    state = _state(model, optim)
    if dist.get_rank() == 1:
        state["optim"]["state"]["blocks.1.fc.weight"]["exp_avg"].to_local()[0, 0] = float("nan")
    checkpoint.save(state, Path(root) / "step_000002")
    checked = _error_of(lambda: checkpoint.load(_state(*_trained(seed=7, steps=0)), Path(root) / "step_000002",
                                                validate_finite=True))
    unchecked = _error_of(lambda: checkpoint.load(_state(*_trained(seed=7, steps=0)), Path(root) / "step_000002"))
    return checked, unchecked


def test_a_non_finite_value_is_named_on_every_rank_when_asked(tmp_path):
    """Case N3: ``load(validate_finite=True)`` names the key holding a NaN on every rank."""
    for (kind, message), unchecked in run_on_ranks(2, _non_finite, str(tmp_path)):
        assert kind == "CheckpointNonFinite"
        assert unchecked is None
        assert "'optim.state.blocks.1.fc.weight.exp_avg' holds 1 non-finite value(s), the first nan" in message


DIES_WHILE_COMMITTING = JOB_STARTED + '''original = checkpoint._seal
def seal_then_die(directory, files):
    original(directory, files)
    os._exit(17)  # rank 0, with the manifest written in the staging directory, before the rename
checkpoint._seal = seal_then_die
checkpoint.save(state(), {root!r} + "/step_000002")
'''


def test_rank_0_killed_while_committing_leaves_the_last_committed_checkpoint_latest(tmp_path):
    """Case C3: rank 0 dies after sealing the staging directory, before renaming it: the
    sealed staging directory is still no checkpoint, and the first one stays latest."""
    from fsdp1 import checkpoint

    _killed_job(DIES_WHILE_COMMITTING, tmp_path)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    staged = [tmp_path / "ckpt" / name for name in names if name.startswith("step_000002.partial-")]
    assert "step_000002" not in names
    assert len(staged) == 1
    assert (staged[0] / checkpoint.MANIFEST).is_file()
    assert not checkpoint.is_committed(staged[0])
    assert checkpoint.latest(tmp_path / "ckpt").name == "step_000001"
    assert checkpoint.verify(tmp_path / "ckpt" / "step_000001")
    with pytest.raises(checkpoint.CheckpointIncomplete, match="not a committed checkpoint"):
        checkpoint.verify(staged[0])


def _saved_in_the_background(root):
    """Case C12 on fsdp1's SHARDED state (DTensors; torch's FSDP1 ShardedTensors fail there)."""

    from fsdp1 import checkpoint

    model, optim = _trained()
    saver = checkpoint.AsyncSaver()
    before = _full(model)
    saver.save(_state(model, optim), Path(root) / "step_000002")
    with torch.no_grad():  # (a) the model changes at once; the checkpoint must not see it
        for p in model.parameters():
            p.add_(1.0)
    saver.save(_state(model, optim), Path(root) / "step_000003")  # (d) waits for the first, never interleaves
    saver.wait()
    first, second = _full(_load_into_fresh(Path(root) / "step_000002")), _full(_load_into_fresh(Path(root) / "step_000003"))
    with _disk_full_on_rank_1():  # (b) the failure comes back from wait(), on every rank
        saver.save(_state(model, optim), Path(root) / "step_000004")
        failure = _error_of(saver.wait)
    return (all(torch.equal(first[k], before[k]) for k in before),
            all(torch.equal(second[k], before[k] + 1) for k in before),
            failure, checkpoint.latest(root).name)


def test_a_background_save_holds_the_state_it_was_given_and_reports_its_failure_on_every_rank(tmp_path):
    for unchanged, mutated, (kind, message), latest in run_on_ranks(2, _saved_in_the_background, str(tmp_path)):
        assert unchanged
        assert mutated
        assert kind == "CheckpointError"
        assert "rank(s) [1]" in message
        assert "No space left on device" in message
        assert latest == "step_000003"
