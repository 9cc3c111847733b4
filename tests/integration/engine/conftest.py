"""The engine tests' record of every vLLM run, printed at the end: which ran, which were emulated."""

from __future__ import annotations

import pytest

_RUNS: list[tuple[str, str, object]] = []


class EngineRuns:
    def record(self, model_type: str, what: str, run):
        _RUNS.append((model_type, what, run))
        return run


@pytest.fixture(scope="session")
def engine_runs() -> EngineRuns:
    return EngineRuns()


def pytest_terminal_summary(terminalreporter):
    if not _RUNS:
        return
    terminalreporter.section("vLLM CPU runs")
    for model_type, what, run in _RUNS:
        terminalreporter.write_line(f"{model_type} {what}: {run.describe()}")
