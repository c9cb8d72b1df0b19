"""Tests that a job that trained with fsdp1 over gloo exits 0 once its work is done: a gloo worker
still dropping the job's last collective while the interpreter finalizes used to abort it
("terminate called without an active exception", SIGABRT) in about 2 of 5 runs of the ``fully_shard``
example. Whole jobs of fresh interpreters (``python job.py`` per rank, as torchrun starts them, without
its agent), since the race is in the interpreter's own exit, which a forked rank never runs."""

from concurrent.futures import ThreadPoolExecutor

from _jobs import failed, run_job

RUNS = 6
"""Without the wait at exit (``group_health.EXIT_GRACE_S``) a job like this one aborted in roughly a third
of its runs, so six clean runs would happen about one time in ten. They run two at a time: a busier
machine makes the race likelier, not less."""


def test_a_fully_shard_job_whose_last_step_is_a_loss_all_reduce_exits_0_every_time(tmp_path):
    body = '''
from _models import batch, lm_loss, make_gpt
model = make_gpt()
for block in model.blocks:
    fsdp1.fully_shard(block)
fsdp1.fully_shard(model)
optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(3):
    loss = lm_loss(model, *batch(step, rank, dist.get_world_size()))
    loss.backward()
    optim.step()
    optim.zero_grad()
report(loss=loss.item())
mean = loss.detach().clone()
dist.all_reduce(mean)  # what a training script logs, right before it ends
dist.destroy_process_group()
'''
    with ThreadPoolExecutor(max_workers=2) as pool:
        # A group timeout of its own: the jobs run two at a time, and a rank held up when its peer
        # enters a collective must not fail the job the test is about.
        jobs = list(pool.map(lambda _: run_job(tmp_path, body, torchrun=False, fork=False, timeout_s=90, pg_timeout_s=30),
                             range(RUNS)))
    for run, job in enumerate(jobs):
        assert not failed(job), failed(job)
        assert job.returncodes == [0, 0], f"run {run + 1} of {RUNS} exited {job.returncodes}:\\n{job.output[-8000:]}"
        assert set(job.reports) == {0, 1}
