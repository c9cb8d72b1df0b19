"""Tests crash and resume under ``torchrun --max-restarts`` (docs/reliability.md, cases R1–R5). The job trains with dropout, a learning-rate schedule and
a data position, and checkpoints through ``fsdp1.checkpoint`` every 2 steps the model, the optimizer,
the schedule, the step and each rank's RNG state; a resumed run must draw the same batches and
dropout masks and produce the same losses, bit for bit, as one never interrupted."""

import pytest

from _jobs import failed, run_job

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

RESTARTS = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # gloo restarts on torch 2.13 (docs/reliability.md)

TRAINING = '''
from pathlib import Path
from fsdp1 import checkpoint
from torch.distributed.checkpoint import FileSystemWriter
ROOT, CRASH = Path({root!r}), {crash!r}
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # the uninterrupted run: no torchrun
torch.manual_seed(0)
model = FSDP(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 3)),
             auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({{nn.Linear}}))
optim = torch.optim.Adam(model.parameters(), lr=1e-2)
schedule = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
torch.manual_seed(1 + rank)  # each rank its own dropout masks and data
def state(step):
    with FSDP.state_dict_type(model, fsdp1.StateDictType.SHARDED_STATE_DICT):
        return {{"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim),
                "schedule": schedule.state_dict(), "step": step, f"rng.rank{{rank}}": torch.get_rng_state()}}
original_write = FileSystemWriter.write_data
def write_then_die(self, plan, planner):
    written = original_write(self, plan, planner)
    written.wait()
    if rank == 1:  # inside a save, its data written, nothing committed
        if CRASH == "sigterm":
            import signal
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        os._exit(17)
    return written
def main():
    first = 0
    latest = checkpoint.latest(ROOT)
    if latest is not None:
        loaded = state(0)
        checkpoint.load(loaded, latest)
        with FSDP.state_dict_type(model, fsdp1.StateDictType.SHARDED_STATE_DICT):
            model.load_state_dict(loaded["model"])
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, loaded["optim"]))
        schedule.load_state_dict(loaded["schedule"])
        torch.set_rng_state(loaded[f"rng.rank{{rank}}"])
        first = loaded["step"]
        print(f"rank {{rank}} resumed from {{latest.name}}", flush=True)
    seen = {{}}
    for step in range(first, 10):
        if CRASH == "always" and rank == 1 and step == 3:
            raise RuntimeError(f"deliberate crash on attempt {{attempt}}")
        if CRASH == "twice" and rank == 1 and step == 6 and attempt == 0:
            os._exit(17)  # killed in a step
        x = torch.randn(4, 8)  # the data position is the RNG's
        out = model(x)
        loss = out.square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        schedule.step()
        seen[step] = [loss.item(), hash(tuple(x.flatten().tolist())), schedule.get_last_lr()[0]]
        if (step + 1) % 2 == 0:
            if (CRASH, attempt, step + 1) in (("twice", 1, 8), ("sigterm", 0, 6)):
                FileSystemWriter.write_data = write_then_die
            checkpoint.save(state(step + 1), ROOT / f"step_{{step + 1:06d}}")
    report(seen=seen, attempt=attempt)
recorded_with_rank_0_failing_later(main)()
'''


def _training(tmp_path, crash, restarts=1):
    root = tmp_path / f"ckpt-{crash}"
    root.mkdir()
    under_torchrun = crash in ("twice", "always")  # the others need no agent
    job = run_job(tmp_path, TRAINING.format(root=str(root), crash=crash), timeout_s=150, torchrun=under_torchrun,
                  env=RESTARTS if under_torchrun else None, torchrun_args=("--max-restarts", str(restarts)))
    assert not failed(job), failed(job)
    return job, root


def test_a_rank_killed_in_a_step_then_inside_a_save_resumes_with_the_same_rng_schedule_and_losses(tmp_path):
    """R1, R2 and R5 under ``--max-restarts=2``: rank 1 dies at step 6 (R1); the restart resumes from
    step_000006 and rank 1 dies again inside the step-8 save (R2); the second restart skips the
    uncommitted step_000008 and resumes from step_000006 again. Every step it runs draws the same
    batch, gets the same learning rate and dropout masks and produces the same loss, bit for bit, as
    the uninterrupted run."""
    straight, _ = _training(tmp_path, None)
    assert straight.returncodes == [0, 0], straight.output[-3000:]
    resumed, root = _training(tmp_path, "twice", restarts=2)
    assert resumed.returncodes == [0], resumed.output[-3000:]
    assert resumed.output.count("rank 0 resumed from step_000006") == 2
    assert sorted(p.name for p in root.iterdir() if ".partial-" not in p.name) == [
        f"step_{n:06d}" for n in (2, 4, 6, 8, 10)]
    for rank in (0, 1):
        assert resumed.reports[rank]["attempt"] == 2
        after = resumed.reports[rank]["seen"]
        assert list(after) == [str(step) for step in range(6, 10)]
        assert after == {step: straight.reports[rank]["seen"][step] for step in after}


def test_a_crash_on_every_attempt_fails_the_job_naming_the_rank_and_the_error(tmp_path):
    """R4: rank 1 raises at step 3 on every attempt (--max-restarts=1): the job fails, and torchrun's
    summary (with ``@record``) names rank 1 and the exception of the last attempt (rank 0, failing
    within milliseconds of it, holds its error a second: ``recorded_with_rank_0_failing_later``)."""
    job, root = _training(tmp_path, "always")
    assert job.returncodes[0] != 0
    assert "Root Cause" in job.output, job.output[-3000:]
    summary = job.output.split("Root Cause")[1]
    assert "rank      : 1 (local_rank: 1)" in summary
    assert "RuntimeError: deliberate crash on attempt 1" in job.output
    assert [p.name for p in root.iterdir()] == ["step_000002"]  # both attempts got as far, nothing more


def test_a_rank_terminated_inside_a_save_ends_the_job_and_the_save_is_no_checkpoint(tmp_path):
    """R3: SIGTERM to rank 1 inside the step-6 save: rank 1 ends, rank 0's save fails instead of
    waiting for it, no process is left, and the uncommitted save is not taken as the latest
    checkpoint."""
    from fsdp1 import checkpoint

    job, root = _training(tmp_path, "sigterm")
    assert job.returncodes[1] == -15
    assert job.returncodes[0] != 0
    assert "step_000006" not in {p.name for p in root.iterdir()}
    assert checkpoint.latest(root).name == "step_000004"
