"""Run every family the architecture registry lists in vLLM's CPU build and print a Markdown table.

    python scripts/engine_table.py [--families llama,qwen3_moe] [--work DIR] [--emulate always]

For each registered model_type: the tiny engine-sized zoo model (tests/integration/engine/engine_models.py)
runs in vLLM as the BF16 control, then as each output format vLLM's CPU build can run; each FP8 run is
compared with the control (first generated token, teacher-forced prompt log-probs within
engine_harness.logprob_bound: 32 times the control's distance from transformers in FP32). Needs the engine
venv (`.ci/run` builds it, or $FP8CONVERT_ENGINE_VENV) and, for the conversions, fp8convert and transformers
in this python. Takes about a minute per family on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for helper_dir in (REPO / "tests" / "integration" / "engine", REPO / "tests" / "support", REPO / "tests"):
    sys.path.insert(0, str(helper_dir))
sys.path.insert(0, str(REPO))

import engine_harness as H  # noqa: E402 (found through the path set above)
import engine_models as M  # noqa: E402


def registered_model_types() -> list[str]:
    from fp8convert.plan.architectures import ARCHITECTURES

    return [t for arch in ARCHITECTURES for t in arch.model_types]


def convert(src: Path, out: Path, fmt: str, scheme: str) -> str | None:
    """None when fp8convert wrote `out`, else its one-line refusal."""
    import fp8convert

    try:
        fp8convert.quantize(str(src), str(out), format=fmt, scheme=scheme, device="cpu")
    except fp8convert.FP8ConvertError as e:
        return str(e).strip().splitlines()[0]
    return None


def cell(control: H.EngineRun, run: H.EngineRun, bound: float) -> str:
    why = H.agreement(control, run, bound)
    if why is None:
        return f"ok ({H.max_logprob_gap(control, run):.3f})" + (", emulated" if run.emulated else "")
    if why.startswith("token mismatch"):
        return "token mismatch" + (", emulated" if run.emulated else "")
    if why.startswith("prompt log-probs"):
        return f"off ({H.max_logprob_gap(control, run):.3f} > {bound:.3f})"
    return f"{run.stage} error"


def family_row(model_type: str, work: Path, emulate: str, errors: list[str]) -> list[str]:
    src = work / model_type / "bf16"
    try:
        M.make_engine_model(model_type, src)
    except Exception as e:  # the zoo model itself cannot be built at these sizes
        errors.append(f"{model_type} build: {type(e).__name__}: {e}")
        return [model_type, "not built"] + ["-"] * (len(M.FORMATS) + 1)
    control = H.run_engine(src, emulate=emulate)
    if not control.ok:
        errors.append(f"{model_type} BF16 control: {control.error}")
        return [model_type, f"{control.stage} error", "-"] + ["-"] * len(M.FORMATS)
    reference = H.transformers_reference(src)
    bound = H.logprob_bound(control, reference)
    if bound is None:
        errors.append(f"{model_type} FP32 reference (transformers): {reference.error}")
        return [model_type, "ok, no FP32 reference", "-"] + ["-"] * len(M.FORMATS)
    row = [model_type, f"ok (top-2 margin {control.margin:.2f})", f"{bound:.3f}"]
    for fmt, scheme in M.FORMATS:
        out = work / model_type / M.FORMAT_IDS[(fmt, scheme)]
        refusal = convert(src, out, fmt, scheme)
        if refusal:
            errors.append(f"{model_type} {M.FORMAT_IDS[(fmt, scheme)]} refused: {refusal}")
            row.append("refused")
            continue
        run = H.run_engine(out, emulate=emulate)
        if H.agreement(control, run, bound) is not None:
            errors.append(f"{model_type} {M.FORMAT_IDS[(fmt, scheme)]}: {H.agreement(control, run, bound)}")
        row.append(cell(control, run, bound))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", help="comma-separated model_types (default: every registered one)")
    p.add_argument("--work", type=Path, help="where models are built (default: a temporary directory)")
    p.add_argument(
        "--emulate",
        choices=("auto", "always"),
        default="auto",
        help="always: emulate the block FP8 GEMM even where AMX kernels exist",
    )
    a = p.parse_args(argv)
    if H.engine_python() is None:
        print(
            f"no vLLM venv at {H.engine_venv()} (build it with .ci/run or set FP8CONVERT_ENGINE_VENV)", file=sys.stderr
        )
        return 2
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    families = a.families.split(",") if a.families else registered_model_types()
    header = ["model_type", "BF16 control", "log-prob bound"] + [M.FORMAT_IDS[f] for f in M.FORMATS]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header), flush=True)
    errors: list[str] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="engine-table-") as tmp:
        work = a.work or Path(tmp)
        for model_type in families:
            print("| " + " | ".join(family_row(model_type, work, a.emulate, errors)) + " |", flush=True)
    print(f"\n{len(families)} families in {time.monotonic() - started:.0f} s\n")
    for line in errors:
        print(f"- {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
