"""Tests that a rank which fails, stops, or drives fsdp1 differently from the others gives an error on
every rank instead of a hang or silently wrong training (docs/reliability.md, cases H1–H3,
H5, H8, H9, and C14). Each case is a whole job in fresh processes with a 2 s gloo timeout
(``_jobs.run_job``), since it breaks its process group on purpose; a job that hangs is killed and
fails the test, and no process may outlive its job."""

import pytest

from _jobs import failed, run_job

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

MODEL = '''
STEP = -1
class Layer(nn.Linear):
    """A unit's module that misbehaves on one rank at one step, as the case says."""
    def __init__(self, name, width=8):
        super().__init__(8, width)
        self.name = name
    def forward(self, x):
        if (self.name, rank, STEP) == MISBEHAVE[:3]:
            MISBEHAVE[3]()
        return torch.tanh(super().forward(x))
class Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = Layer("a"), Layer("b"), Layer("c")
    def forward(self, x):
        return self.c(self.b(self.a(x)))
torch.manual_seed(0)
model = FSDP(Three(), auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Layer}))
optim = torch.optim.SGD(model.parameters(), lr=0.1)
def step(n):
    global STEP
    STEP = n
    torch.manual_seed(100 + n)
    loss = model(torch.randn(4, 8)).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()
def deliberate():
    raise ValueError("deliberate failure on rank 1")
'''


CONDITIONAL_ENCODER = MODEL + '''
class WithEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.head = Layer("encoder"), Layer("head", width=3)
    def forward(self, x):
        if rank == 0 and STEP == 1:
            x = self.encoder(x)
        return self.head(x)
model = FSDP(WithEncoder(), auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Layer}))
optim = torch.optim.SGD(model.parameters(), lr=0.1)
MISBEHAVE = (None,) * 4
try:
    for n in range(3):
        step(n)
    report(error=None)
except Exception as error:
    report(error=described(error))
'''  # the encoder runs on rank 0 only, at step 1 (H5, H6)


RAISES_ON_RANK_1 = MODEL + '''
MISBEHAVE = ("b", 1, 2, deliberate)
def main():
    for n in range(4):
        try:
            step(n)
        except Exception as error:
            report(error=described(error))
            raise
'''  # uncaught on rank 1 at step 2 (H1, H2)


def _assert_broken(report, *fragments):
    assert report["type"] == "ProcessGroupBroken", report
    assert report["exception"], report
    for fragment in fragments:
        assert fragment in report["message"], (fragment, report["message"])


FULLY_SHARD_MODEL = MODEL.replace("model = FSDP(Three(), auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Layer}))", '''
model = Three()
for layer in (model.a, model.b, model.c):
    fsdp1.fully_shard(layer)
fsdp1.fully_shard(model)''')


@pytest.mark.parametrize("api", ["FullyShardedDataParallel", "fully_shard"])
def test_an_exception_swallowed_on_one_rank_breaks_the_group_on_every_rank_instead_of_training_on(api, tmp_path):
    """H3 ⚠: rank 1's b raises at step 2 and its loop swallows every error (torch's FSDP1 then pairs
    rank 1's next all-gathers with rank 0's, trains on silently and exits 0). Rank 0's all-gather for
    c fails at the timeout; rank 1's next forward first checks that the ranks are in step and fails
    at the timeout too; every later call raises at once, and the job fails (a FullyShardedDataParallel
    state dict is collective and raises too; a fully_shard one is local, so a sixth step does)."""
    model, poisoned = (MODEL, "model.state_dict()") if api == "FullyShardedDataParallel" else (FULLY_SHARD_MODEL, "step(5)")
    job = run_job(tmp_path, model + f'''
MISBEHAVE = ("b", 1, 2, deliberate)
errors = []
for n in range(5):
    try:
        step(n)
        errors.append(None)
    except Exception as error:  # the swallowing loop
        errors.append(described(error))
report(errors=errors)
{poisoned}  # poisoned: raises, so the job cannot exit 0
''', torchrun=False)
    assert not failed(job), failed(job)
    assert all(code != 0 for code in job.returncodes)
    for rank in (0, 1):
        errors = job.reports[rank]["errors"]
        assert errors[:2] == [None, None], errors
        assert all(errors[2:]), errors
        _assert_broken(errors[4], "this process group broke earlier")
    assert job.reports[1]["errors"][2]["type"] == "ValueError"  # its own error, at once
    _assert_broken(job.reports[1]["errors"][3], "Not every rank reached fsdp1's check after an exception escaped",
                   "skip a batch on every rank or on none", "failed on rank 1")
    _assert_broken(job.reports[0]["errors"][2], "for unit 'c'", "failed on rank 0")
    _assert_broken(job.reports[0]["errors"][3], "this process group broke earlier")
    assert "ProcessGroupBroken" in job.output
    assert "this process group broke earlier" in job.output


@pytest.mark.parametrize("api", ["state_dict", "optim_state_dict", "summon_full_params"])
def test_a_collective_api_called_on_rank_0_only_is_named_on_every_rank(api, tmp_path):
    """C14: ``state_dict()`` (or the optimizer's, or ``summon_full_params``) under ``if rank == 0``
    while rank 1 goes on training: rank 0 is told that rank 1 never came, rank 1 that its next
    all-gather failed; torch's fails with a cryptic gloo error, or hangs on NCCL."""
    call = {
        "state_dict": "model.state_dict()",
        "optim_state_dict": "FSDP.optim_state_dict(model, optim)",
        "summon_full_params": "FSDP.summon_full_params(model).__enter__()",
    }[api]
    job = run_job(tmp_path, MODEL + f'''
MISBEHAVE = (None,) * 4
step(0)
try:
    if rank == 0:
        {call}
    step(1)
    report(error=None)
except Exception as error:
    report(error=described(error))
''', torchrun=False)
    assert not failed(job), failed(job)
    _assert_broken(job.reports[0]["error"], f"Not every rank reached {api}()", f"{api}() is a collective",
                   "Ranks 1 failed to pass monitoredBarrier")
    _assert_broken(job.reports[1]["error"], "all-gather", "for unit 'a'", "failed on rank 1")


def test_a_rank_that_stops_is_named_by_the_others_and_the_job_ends(tmp_path):
    """H9: rank 1 sleeps 60 s inside b at step 1 under torchrun. Rank 0's all-gather for c fails at
    the group's timeout naming the collective, the unit and its last collectives; torchrun then
    stops rank 1, so the job ends long before the sleep would."""
    job = run_job(tmp_path, MODEL + '''
import time
MISBEHAVE = ("b", 1, 1, lambda: time.sleep(60))
step(0)
try:
    step(1)
except Exception as error:
    report(error=described(error))
    raise
''', timeout_s=50)
    assert not failed(job), failed(job)
    assert job.returncodes[0] != 0
    assert list(job.reports) == [0]
    _assert_broken(job.reports[0]["error"], "all-gather of 36 float32 elements for unit 'c'", "failed on rank 0",
                   "process group of ranks [0, 1]; rank(s) [1] did not take part in time", "The last collectives this rank issued here:")


def test_an_uncaught_exception_on_one_rank_ends_the_job_naming_it_as_the_root_cause(tmp_path):
    """H1: rank 1 raises in b at step 2 under torchrun with ``@record``: the job fails, torchrun's
    summary names rank 1 and the exception, and rank 0 gets ProcessGroupBroken instead of waiting.
    The agent looks at its workers every 3 s here (0.1 s by default, when it may stop rank 0 before a
    loaded machine let it report what it saw). torchrun names as root cause the failure with the
    earliest timestamp in whole seconds, a tie going to the lower rank; rank 0's error comes within
    milliseconds of rank 1's exit, so rank 0 holds its error 1.1 s before raising it."""
    job = run_job(tmp_path, RAISES_ON_RANK_1 + '''
recorded_with_rank_0_failing_later(main)()
''', torchrun_args=("--monitor-interval", "3"))
    assert not failed(job), failed(job)
    assert job.returncodes[0] != 0
    assert "rank      : 1 (local_rank: 1)" in job.output.split("Root Cause")[1]
    assert "ValueError: deliberate failure on rank 1" in job.output
    assert job.reports[1]["error"]["type"] == "ValueError"
    _assert_broken(job.reports[0]["error"], "failed on rank 0")


def test_without_an_agent_the_surviving_rank_raises_and_exits(tmp_path):
    """H2: the same crash with two plain processes and no torchrun: rank 0 raises ProcessGroupBroken
    and exits non-zero instead of waiting for a peer that is gone."""
    job = run_job(tmp_path, RAISES_ON_RANK_1 + 'main()\n', torchrun=False)
    assert not failed(job), failed(job)
    assert job.returncodes[0] != 0
    assert job.returncodes[1] != 0
    _assert_broken(job.reports[0]["error"], "failed on rank 0")


def test_a_straggler_within_the_timeout_trains_on_as_if_it_had_not_waited(tmp_path):
    """H8: rank 1 sleeps 1 s in b (the timeout is 6 s here, a wide margin on a loaded machine): no
    error, and the losses equal a run where nobody waits."""
    job = run_job(tmp_path, MODEL + '''
import time
losses = {}
for slow in (False, True):
    MISBEHAVE = ("b", 1, 1 if slow else -2, lambda: time.sleep(1))
    torch.manual_seed(0)
    model = FSDP(Three(), auto_wrap_policy=fsdp1.wrap.ModuleWrapPolicy({Layer}))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses[slow] = [step(n) for n in range(3)]
report(losses=losses)
''', torchrun=False, pg_timeout_s=6)
    assert not failed(job), failed(job)
    assert job.returncodes == [0, 0]
    for rank in (0, 1):
        losses = job.reports[rank]["losses"]
        assert losses["true"] == losses["false"]


def test_a_submodule_run_on_one_rank_only_is_named_on_every_rank(tmp_path):
    """H5: an encoder that only rank 0 runs at step 1 (pytorch#152964: torch's hangs until the
    timeout). Rank 0's all-gather for the encoder meets rank 1's for the head, whose size differs:
    gloo itself aborts rank 1 ("collective mismatch", which no Python code can catch), and rank 0's
    ProcessGroupBroken names the unit. Nobody hangs."""
    job = run_job(tmp_path, CONDITIONAL_ENCODER, torchrun=False)
    assert not failed(job), failed(job)
    _assert_broken(job.reports[0]["error"], "all-gather of 36 float32 elements for unit 'encoder'", "failed on rank 0")
    assert job.returncodes[1] != 0
    assert 1 not in job.reports
    assert "collective mismatch" in job.output


def test_with_collective_fingerprints_a_mismatch_is_named_on_every_rank_before_it_is_issued(tmp_path):
    """H6: under FSDP1_DEBUG_COLLECTIVES=1 the ranks compare each collective before issuing it, so the
    encoder of H5 is named on both ranks at once (no abort, no timeout), each naming its own unit."""
    job = run_job(tmp_path, CONDITIONAL_ENCODER, torchrun=False, env={"FSDP1_DEBUG_COLLECTIVES": "1"})
    assert not failed(job), failed(job)
    _assert_broken(job.reports[0]["error"], "all-gather of 36 float32 elements for unit 'encoder' is not what every "
                   "rank issues", "rank(s) [1] issue another op, size, dtype or unit")
    _assert_broken(job.reports[1]["error"], "all-gather of 14 float32 elements for unit 'head' is not what every "
                   "rank issues", "rank(s) [0] issue another op")


EVAL_THEN_DESTROY = MODEL + '''
MISBEHAVE = (None,) * 4
model.eval()
with torch.no_grad():
    output = model(torch.randn(4, 8))
report(output=output.sum().item())
dist.destroy_process_group()  # no barrier first: a rank may tear down while its peer finishes
'''


def test_an_eval_forward_then_teardown_without_a_barrier_exits_cleanly_every_time(tmp_path):
    """A short job (an evaluation, then ``destroy_process_group()`` with no barrier) must exit 0: a
    scheduler counts an abort at exit as a failed job. Nothing fsdp1 issued may still be in flight
    when the forward returns, so each rank can tear its group down at once. Repeated, since a race
    there shows only now and then."""
    outputs = set()
    for _ in range(12):
        job = run_job(tmp_path, EVAL_THEN_DESTROY, torchrun=False)
        assert not failed(job), failed(job)
        assert job.returncodes == [0, 0], job.output[-2000:]
        outputs.update(job.reports[rank]["output"] for rank in (0, 1))
    assert len(outputs) == 1
