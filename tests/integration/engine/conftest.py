"""The engine tests' shared fixtures (the engine venv, each family's model and BF16 control, cached
conversions) and their record of every vLLM run, printed at the end: which ran, which were emulated."""

from __future__ import annotations

import os

import engine_harness as H
import engine_models as M
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


@pytest.fixture(scope="session", autouse=True)
def engine_venv():
    if H.engine_python() is None:
        message = f"no vLLM venv at {H.engine_venv()} (.ci/run builds it; or set FP8CONVERT_ENGINE_VENV)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def family(tmp_path_factory, engine_runs):
    """family(model_type) -> (source dir, BF16 control, FP32 reference, log-prob bound); built and run once."""
    cache: dict = {}

    def get(model_type: str):
        if model_type not in cache:
            src = M.make_engine_model(model_type, tmp_path_factory.mktemp(f"engine-{model_type}") / "bf16")
            control = engine_runs.record(model_type, "BF16 control", H.run_engine(src))
            reference = H.transformers_reference(src)
            bound = H.logprob_bound(control, reference) if control.ok else None
            cache[model_type] = (src, control, reference, bound)
        return cache[model_type]

    return get


@pytest.fixture(scope="session")
def converted_for_engine(tmp_path_factory, family):
    """converted_for_engine(model_type, fmt, scheme, experts=None) -> output dir, converted once; with
    `experts` (a scheme), the mixed recipe that gives `mlp.experts.*` that scheme and the rest `scheme`."""
    cache: dict = {}

    def get(model_type: str, fmt: str, scheme: str, experts: str | None = None):
        key = (model_type, fmt, scheme, experts)
        if key not in cache:
            import fp8convert

            name = f"engine-{model_type}-{fmt}-{scheme}" + (f"+{experts}" if experts else "")
            out = tmp_path_factory.mktemp(name) / "out"
            recipe = [(M.EXPERTS, experts)] if experts else ()
            src = str(family(model_type)[0])
            fp8convert.quantize(src, str(out), format=fmt, scheme=scheme, recipe=recipe, device="cpu")
            cache[key] = out
        return cache[key]

    return get
