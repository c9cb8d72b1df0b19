import pytest

from _harness import close_pools


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    yield
    close_pools()
