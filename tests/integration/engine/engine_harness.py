"""Runs vLLM's CPU build on a model directory in a child process (engine_child.py) and compares runs.

The engine lives in a virtual environment of its own (vLLM pins its own torch and transformers):
$FP8CONVERT_ENGINE_VENV, default `.venv-engine` at the repository root (`.ci/run` builds it).

    from engine_harness import engine_python, run_engine
    control = run_engine(model_dir)                     # BF16 control
    result = run_engine(fp8_dir)
    agreement(control, result, bound)                   # None when they agree, else why not
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
CHILD = HERE / "engine_child.py"
SITE = HERE / "engine_site"  # on the engine's PYTHONPATH: lets PyPI's torchvision import (its sitecustomize says how)
PROMPT_IDS = (1, 17, 42, 99, 123, 7, 250, 64, 3, 200, 31, 5)
CHILD_TIMEOUT_S = 600


def engine_venv() -> Path:
    return Path(os.environ.get("FP8CONVERT_ENGINE_VENV") or REPO_ROOT / ".venv-engine")


def engine_python() -> Path | None:
    """The engine venv's python, or None where the venv has not been built."""
    python = engine_venv() / "bin" / "python"
    return python if python.exists() else None


@dataclass(frozen=True)
class EngineRun:
    ok: bool
    token: int | None = None
    prompt_logprobs: tuple[float, ...] = ()  # teacher-forced log p of prompt tokens 1..n-1
    margin: float | None = None  # top-1 minus top-2 log-prob of the generated token
    top: tuple[int, ...] = ()  # the top-2 candidates for the generated token
    emulated: bool = False  # a block FP8 GEMM or MoE kernel was emulated (no AMX), or an FP4 one replaced
    stage: str = ""  # where a failed run stopped: "load" or "generate"
    error: str = ""
    emulated_kinds: tuple[tuple[str, int], ...] = ()  # ("nvfp4 linear", layers), ("fp8-block moe", layers), ...
    replaced_because: tuple[str, ...] = ()  # vLLM's own refusals where the child put in an FP4 kernel
    fused_nvfp4_layers: int = 0  # fused NVFP4 layers (q/k/v, gate/up, each expert's gate/up) vLLM loaded
    split_global_scales: tuple[str, ...] = ()  # those loaded with more than one global scale, with the values

    def describe(self) -> str:
        if self.ok:
            kinds = ", ".join(f"{kind} x{n}" for kind, n in self.emulated_kinds)
            return f"token {self.token}" + (
                f" (emulated: {kinds})" if kinds else " (emulated GEMM)" if self.emulated else ""
            )
        return f"{self.stage} error: {self.error}"


def run_engine(model_dir, dtype: str = "bfloat16", emulate: str = "auto", prompt=PROMPT_IDS) -> EngineRun:
    """One vLLM run of `model_dir` in a child process of the engine venv."""
    python = engine_python()
    if python is None:
        raise FileNotFoundError(f"no vLLM venv at {engine_venv()} (build it with .ci/run)")
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(SITE),  # and nothing else of ours
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOGGING_LEVEL="ERROR",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    cmd = [str(python), str(CHILD), str(model_dir), json.dumps(list(prompt)), "--dtype", dtype, "--emulate", emulate]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return EngineRun(ok=False, stage="timeout", error=f"no result after {CHILD_TIMEOUT_S} s")
    for line in proc.stdout.splitlines():
        if line.startswith("ENGINE_RESULT "):
            d = json.loads(line[len("ENGINE_RESULT ") :])
            if not d["ok"] and "failed to be inspected" in d["error"]:  # the cause is in vLLM's log
                d["error"] += " (" + _last_error_line(proc.stdout + proc.stderr) + ")"
            return EngineRun(
                ok=d["ok"],
                token=d.get("token"),
                prompt_logprobs=tuple(d.get("prompt_logprobs", [None])[1:]),
                margin=d.get("margin"),
                top=tuple(d.get("top", ())),
                emulated=d.get("emulated", False),
                stage=d.get("stage", ""),
                error=d.get("error", ""),
                emulated_kinds=tuple(sorted(d.get("emulated_kinds", {}).items())),
                replaced_because=tuple(d.get("replaced_because", ())),
                fused_nvfp4_layers=d.get("fused_nvfp4_layers", 0),
                split_global_scales=tuple(d.get("split_global_scales", ())),
            )
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    return EngineRun(ok=False, stage="crash", error=f"exit {proc.returncode}: {tail}"[:600])


def _last_error_line(log: str) -> str:
    """The last 'SomethingError: ...' vLLM logged (the model inspection subprocess's own failure)."""
    found = re.findall(r"\b(\w+(?:Error|Exception): [^\n]+)", log)
    return found[-1].strip()[:300] if found else "no cause logged"


def max_logprob_gap(a: EngineRun, b: EngineRun) -> float:
    """The largest distance between their teacher-forced log-probs (NaN where either has a NaN)."""
    gaps = [abs(x - y) for x, y in zip(a.prompt_logprobs, b.prompt_logprobs, strict=True)]
    return math.nan if any(math.isnan(g) for g in gaps) else max(gaps)


def transformers_reference(model_dir) -> EngineRun:
    """The same prompt through transformers in FP32 (this process's torch and transformers): the
    exact computation the BF16 control approximates."""
    import torch
    import zoo

    try:
        logits = zoo.logits(model_dir, prompt_ids=PROMPT_IDS)
    except Exception as e:  # noqa: BLE001 - reported as the reference's failure
        return EngineRun(ok=False, stage="transformers", error=f"{type(e).__name__}: {e}"[:300])
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    top = torch.topk(logprobs[-1], 2)
    return EngineRun(
        ok=True,
        token=int(top.indices[0]),
        top=tuple(int(i) for i in top.indices),
        margin=float(top.values[0] - top.values[1]),
        prompt_logprobs=tuple(float(logprobs[i, PROMPT_IDS[i + 1]]) for i in range(len(PROMPT_IDS) - 1)),
    )


# How far an FP8 conversion may move a teacher-forced log-prob, from the BF16 control's own error (its
# largest distance from the FP32 reference, which comes from rounding activations to BF16, 2**-8
# relative). e4m3 rounds 2**4 times coarser (3 mantissa bits against 7), and it rounds the weights and,
# in the W8A8 schemes, the activations as well: twice 16 times the control's error. A wrong load (a
# misplaced expert, a scale on the wrong rows) moves log-probs by whole nats. The floor keeps the bound
# meaningful where the control happens to match the reference almost exactly.
FP8_OVER_BF16 = 2 * 2.0**4
BOUND_FLOOR = 0.05


def logprob_bound(control: EngineRun, reference: EngineRun) -> float | None:
    """None where there is no reference to measure the control's error against."""
    if not (control.ok and reference.ok):
        return None
    return max(FP8_OVER_BF16 * max_logprob_gap(control, reference), BOUND_FLOOR)


# How far a weight-only FP4 output's run in vLLM may be from the same checkpoint dequantized to FP32 and
# run in transformers in FP32. Not the BF16 model: FP4 rounding itself moves log-probs by tenths of a
# nat (13 to 34 times the control's error on the test models); that is the converter's accuracy, which
# tests/integration/test_fp4_output.py bounds. The engine dequantizes the same codes and scales once and
# multiplies in BF16, so what separates the two is what separates the BF16 control from the FP32
# original: activations rounded to BF16 (2**-8 relative), plus the dequantized weights rounded to BF16,
# at most as much again (an NVFP4 value, e2m1 * e4m3 / global scale, can have more bits than BF16 keeps;
# MXFP4's, e2m1 * 2**k, are exact): twice the control's error, doubled again for the spread of a maximum
# over the prompt's positions. The floor (BF16's rounding of a log-prob near -5: 5 * 2**-8) keeps it
# meaningful where the control happens to match the reference almost exactly. Wrongly decoded FP4
# weights (nibbles swapped, a global scale ignored, group scales on the wrong rows) move log-probs by
# 0.5 to 5 nats on the test models (test_engine_fp4.py checks the runs against those too).
FP4_OVER_BF16 = 4.0
FP4_BOUND_FLOOR = 0.02
# Where the output's FP8 layers also quantize activations (the channel scheme: dynamic per-token e4m3,
# W8A8 in every vLLM CPU kernel for it), the reference does not: e4m3 rounds 16 times coarser than BF16,
# as logprob_bound counts it.
FP8_ACTIVATIONS_OVER_BF16 = 2.0**4


def fp4_logprob_bound(control: EngineRun, reference: EngineRun, fp8_activations: bool = False) -> float | None:
    """None where there is no reference to measure the control's error against."""
    if not (control.ok and reference.ok):
        return None
    factor = FP4_OVER_BF16 + (FP8_ACTIVATIONS_OVER_BF16 if fp8_activations else 0.0)
    return max(factor * max_logprob_gap(control, reference), FP4_BOUND_FLOOR)


def agreement(control: EngineRun, run: EngineRun, bound: float) -> str | None:
    """None when `run` agrees with `control` (same first generated token, every teacher-forced prompt
    log-prob within `bound`), else one line saying how it differs. Where the control's own top-2
    margin is within `bound`, FP8 noise may legitimately swap its two candidates: then the run's token
    must be one of them."""
    if not run.ok:
        return run.describe()
    close_call = control.margin is not None and control.margin <= bound and run.token in control.top
    if run.token != control.token and not close_call:
        return f"token mismatch: {run.token} != control's {control.token} (control's top-2 margin {control.margin:.3f})"
    gap = max_logprob_gap(control, run)
    if not gap <= bound:  # NaN too
        return f"prompt log-probs {gap:.4f} from the control's (bound {bound:.4f})"
    return None
