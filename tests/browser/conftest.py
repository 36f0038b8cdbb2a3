from __future__ import annotations

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Each phase's report on the test item, for fixtures to see whether the test failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report
