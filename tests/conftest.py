import os

import pytest

from _harness import close_pools

WITHOUT_TORCH_FSDP1 = os.environ.get("FSDP1_WITHOUT_TORCH_FSDP1") == "1"
# What the refusals of tests/without_torch_fsdp1/sitecustomize.py say, as they read inside a repr too
# (which escapes the apostrophe of "torch's").
REMOVED, FSDP1_AT_FAULT = "FSDP1 removed (make test-without-torch-fsdp1)", "fsdp1 reached torch"


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    yield
    close_pools()


def _skipped_if_it_wanted_torchs_fsdp1(report, path, line):
    """Under ``make test-without-torch-fsdp1``, a test (or a test module) that failed only because it,
    or a client it runs, wanted torch's FSDP1 as an oracle is reported as skipped, saying so; one
    where fsdp1 itself wanted it still fails."""
    text = str(report.longrepr)
    if WITHOUT_TORCH_FSDP1 and report.failed and REMOVED in text and FSDP1_AT_FAULT not in text:
        report.outcome = "skipped"
        report.longrepr = (str(path), line, "needs torch's FSDP1, which this run removes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _skipped_if_it_wanted_torchs_fsdp1(outcome.get_result(), item.path, item.location[1])


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _skipped_if_it_wanted_torchs_fsdp1(outcome.get_result(), collector.path, 0)
