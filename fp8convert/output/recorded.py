"""The plan an output's manifest records, rebuilt from its source as it is now (for finalize_output)."""

from __future__ import annotations

from pathlib import Path

from ..errors import FP8ConvertError, PlanMismatchError
from ..options import HubAccess, Options
from ..plan.build import build_plan
from ..plan.plan import Plan
from ..source.resolve import recorded_source
from .manifest import WORK_DIR, Manifest, plan_change, source_change
from .ownership import replace_advice

RECORDED = ("fingerprint", "source", "scheme", "format", "ignore", "max_shard_size")  # what a rebuild needs


def recorded_plan(out_dir: Path, hub: HubAccess) -> Plan:
    """The workers' plan again, from the source, revision and Options the manifest records (headers only);
    refused when the source no longer gives that plan or its bytes changed."""
    if not out_dir.is_dir():
        raise FP8ConvertError(f"{out_dir}: no such output directory")
    manifest = Manifest(out_dir)
    state = manifest.read()
    if state is None:
        raise FP8ConvertError(f"{out_dir}: no {WORK_DIR}/manifest.json, so no fp8convert worker started here")
    lacking = [k for k in RECORDED if k not in state]
    if lacking:
        raise FP8ConvertError(
            f"{manifest.path}: does not record {lacking[0]} (written by an older fp8convert); "
            "rerun the quantize command to finish the output"
        )
    plan = build_plan(recorded_source(state, hub), Options.from_record(state))
    if plan.fingerprint != state["fingerprint"]:
        raise PlanMismatchError(
            f"{out_dir}: the source no longer gives the plan the workers used "
            f"({plan_change(state, plan)}); " + replace_advice(out_dir, "rerun the conversion with --overwrite")
        )
    changed = source_change(state, plan.source)
    if changed:
        raise PlanMismatchError(
            f"{out_dir}: the source changed since the workers read it ({changed}); "
            + replace_advice(out_dir, "rerun the conversion with --overwrite")
        )
    return plan
