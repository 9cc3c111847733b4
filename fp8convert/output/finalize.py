"""Preparing OUT (whose files it holds, refusals, resume) and finishing it.

A shard gets its final name only by a rename after fsync, so a final-named shard of the planned size is
finished: a rerun (or another worker) skips it. config.json and the index are written last, so their
presence means complete. The manifest lists the names a conversion writes at OUT's top level; anything
else there is the user's and never deleted: a command that would replace it is refused instead.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..errors import FP8ConvertError, PlanMismatchError
from ..files import fsync_dir, json_bytes, write_atomic
from ..options import CONFIG_DTYPE_KEYS, HubAccess, Options
from ..plan.build import build_plan
from ..plan.plan import Plan
from ..safetensors_io import DTYPES, INDEX_NAME, read_header
from ..source import recorded_source
from ..source.checkpoint import index_files, parse_index
from ..units import listed
from .card import keep_verification, make_card, read_source_card
from .lock import OutputLock, is_lock_file
from .manifest import MANIFEST, WORK_DIR, Manifest, plan_change, source_change
from .partial import RECORD_SUFFIX

YOURSELF = "delete the folder yourself or choose another output directory"
RECORDED = ("fingerprint", "source", "scheme", "format", "ignore", "max_shard_size")  # what a rebuild needs


def prepare_output(
    plan: Plan, out_dir: Path, overwrite: bool, streamed: bool, lock: OutputLock
) -> tuple[set[int], bool]:
    """Make OUT ready, claiming nothing yet (Manifest.claim does, once the run can start): (shards finished
    by an earlier run of this plan, complete?). `lock` is taken once OUT is known to be fp8convert's,
    before anything in it is read or changed. `streamed`: OUT's work folder holds the source's shards."""
    src = plan.source.root
    if not streamed and is_inside(out_dir, src):
        raise FP8ConvertError(f"{out_dir}: the output must not be the source directory or inside it")
    if not streamed and is_inside(src, out_dir):
        raise FP8ConvertError(f"{out_dir}: the output must not contain the source directory {src}")
    if out_dir.exists() and not out_dir.is_dir():
        raise FP8ConvertError(f"{out_dir}: exists and is not a directory")
    # Only the work folder, without a manifest, is empty in every way that matters: left by a run killed
    # before its manifest existed, or made by a worker started a moment earlier.
    entries = [p.name for p in out_dir.iterdir()] if out_dir.is_dir() else []
    work = out_dir / WORK_DIR
    fresh = entries == [WORK_DIR] and work.is_dir() and not work.is_symlink() and not (work / MANIFEST).exists()
    occupied = bool(entries) and not fresh
    # A folder with fp8convert's manifest is resumed, files the user added to it left alone; only
    # replacing it (--overwrite) needs every file in it to be fp8convert's.
    if occupied and (overwrite or read_for_resume(out_dir) is None):
        refuse_foreign(out_dir, overwrite)
    lock.acquire()
    if occupied and overwrite:
        refuse_foreign(out_dir, overwrite)  # again, under the lock
        remove([e for e in out_dir.iterdir() if e.name != WORK_DIR])
        empty_work_folder(out_dir)
    elif occupied and (state := read_for_resume(out_dir)) is not None:
        try:
            check_same_conversion(state, plan, out_dir)
        except PlanMismatchError:
            # Another conversion's, but it wrote nothing to keep (no output, no unit of a partial shard) and
            # no other run writes here (the lock is this run's alone): start afresh, the user's files kept.
            outputs = state.get("outputs")
            if not (
                lock.count == 1
                and isinstance(outputs, list)
                and not any((out_dir / name).exists() for name in outputs)
                and not any(work.glob("*" + RECORD_SUFFIX))
            ):
                raise
            empty_work_folder(out_dir)
        else:
            done = finished_shards(plan, out_dir)
            ends = all((out_dir / name).is_file() for name in ("config.json", INDEX_NAME))
            return done, bool(state.get("complete")) and len(done) == len(plan.shards) and ends
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FP8ConvertError(f"{out_dir}: cannot create ({e.strerror})") from e
    if not os.access(out_dir, os.W_OK):
        raise FP8ConvertError(f"{out_dir}: not writable")
    return set(), False


def is_inside(child: Path, parent: Path) -> bool:
    child, parent = child.resolve(), parent.resolve()
    return child == parent or parent in child.parents


def read_for_resume(out_dir: Path) -> dict | None:
    try:
        return Manifest(out_dir).read()
    except FP8ConvertError as e:
        raise FP8ConvertError(
            f"{e}: {out_dir} cannot be resumed, and fp8convert cannot tell its files there from others' to "
            f"replace them; {YOURSELF}"
        ) from e


def check_same_conversion(state: dict, plan: Plan, out_dir: Path) -> None:
    """OUT holds a run of this very conversion: same plan, and the same source bytes."""
    if state.get("fingerprint") != plan.fingerprint:
        raise PlanMismatchError(
            f"{out_dir}: holds a conversion with a different plan ({plan_change(state, plan)}); "
            "rerun the original command to resume it, or " + replace_advice(out_dir, "pass --overwrite to replace it")
        )
    if changed := source_change(state, plan.source):
        how = (
            "" if plan.source.revision else "; fp8convert records each file's size and modification time, not its bytes"
        )
        raise PlanMismatchError(
            f"{out_dir}: was started from another state of the source ({changed}{how}); "
            + replace_advice(out_dir, "pass --overwrite to start again from the source as it is now")
        )


def recorded_plan(out_dir: Path, hub: HubAccess) -> Plan:
    """The workers' plan rebuilt from the manifest (headers only); refused when the source no longer gives it."""
    if not out_dir.is_dir():
        raise FP8ConvertError(f"{out_dir}: no such output directory")
    manifest = Manifest(out_dir)
    state = manifest.read()
    if state is None:
        raise FP8ConvertError(f"{out_dir}: no {WORK_DIR}/{MANIFEST}, so no fp8convert worker started here")
    if lacking := [k for k in RECORDED if k not in state]:
        raise FP8ConvertError(
            f"{manifest.path}: does not record {lacking[0]} (written by an older fp8convert); "
            "rerun the quantize command to finish the output"
        )
    plan = build_plan(recorded_source(state, hub), Options.from_record(state))
    again = "rerun the conversion with --overwrite"
    if plan.fingerprint != state["fingerprint"]:
        raise PlanMismatchError(
            f"{out_dir}: the source no longer gives the plan the workers used ({plan_change(state, plan)}); "
            + replace_advice(out_dir, again)
        )
    if changed := source_change(state, plan.source):
        raise PlanMismatchError(
            f"{out_dir}: the source changed since the workers read it ({changed}); " + replace_advice(out_dir, again)
        )
    return plan


# ------------------------------------------------------------------ whose files OUT holds


def foreign_entries(out_dir: Path) -> list[str]:
    """OUT's top-level entries that fp8convert did not write, sorted (directories end in '/'). A manifest
    that cannot be read, or that lists no outputs, cannot tell fp8convert's files from others': refused."""
    entries = {p.name: p for p in out_dir.iterdir()} if out_dir.is_dir() else {}
    manifest = Manifest(out_dir)
    ours = {WORK_DIR}
    if manifest.path.is_file():
        try:
            recorded = (manifest.read() or {}).get("outputs")
        except FP8ConvertError as e:
            raise FP8ConvertError(
                f"{e}: fp8convert cannot tell its files in {out_dir} from others', so it replaces nothing there; "
                + YOURSELF
            ) from e
        if not isinstance(recorded, list):
            raise FP8ConvertError(
                f"{manifest.path}: does not list the files fp8convert wrote (an older output), so it replaces "
                f"nothing in {out_dir}; {YOURSELF}"
            )
        ours |= set(recorded)
    return sorted(n + ("/" if p.is_dir() and not p.is_symlink() else "") for n, p in entries.items() if n not in ours)


def refuse_foreign(out_dir: Path, overwrite: bool) -> None:
    """The one refusal for an OUT holding someone else's files (never suggesting --overwrite: it cannot help)."""
    if foreign := foreign_entries(out_dir):
        why = " (--overwrite replaces only an earlier fp8convert output)" if overwrite else ""
        raise FP8ConvertError(
            f"{out_dir}: holds files fp8convert did not write ({listed(foreign)}); choose an "
            f"empty or new output directory{why}"
        )


def replace_advice(out_dir: Path, what: str) -> str:
    """How to start OUT again: `what` when --overwrite may replace it, else what stands in the way."""
    if foreign := foreign_entries(out_dir):
        return f"move {listed(foreign)} out of {out_dir} or choose another output directory"
    return what


def empty_work_folder(out_dir: Path) -> None:
    """Delete what OUT's work folder holds but the lock files, which hold this run's lock."""
    work = out_dir / WORK_DIR
    if work.is_dir() and not work.is_symlink():
        remove([e for e in work.iterdir() if not is_lock_file(e.name)])
    elif work.exists() or work.is_symlink():
        remove([work])


def remove(entries: list[Path]) -> None:
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


# ------------------------------------------------------------------ finishing


def finished_shards(plan: Plan, out_dir: Path) -> set[int]:
    return {s.index for s in plan.shards if (p := out_dir / s.name).is_file() and p.stat().st_size == s.size}


def finalize(plan: Plan, out_dir: Path) -> None:
    """Copy side files, then write the card, the index and config.json last: their presence means complete."""
    done = finished_shards(plan, out_dir)
    if missing := [s.name for s in plan.shards if s.index not in done]:
        raise FP8ConvertError(
            f"{out_dir / missing[0]}: missing or incomplete ({len(missing)} of "
            f"{len(plan.shards)} shards); rerun the conversion to finish it"
        )
    for name in plan.source.copy_files:
        write_atomic(out_dir / name, (plan.source.root / name).read_bytes())  # side files are small
    manifest = Manifest(out_dir)
    card = make_card(plan, read_source_card(plan.source.root), base_model=(manifest.read() or {}).get("base_model"))
    if (previous := out_dir / "README.md").is_file():  # finalizing again: keep what verify added
        card = keep_verification(previous.read_text(), card)
    write_atomic(out_dir / "README.md", card.encode())
    weight_map = {name: shard.name for shard in plan.shards for name in shard.tensors}
    total_size = sum(t.nbytes for s in plan.shards for t in s.tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    write_atomic(out_dir / INDEX_NAME, json_bytes(index))
    # the source's config.json, key order kept, without compression_config (quantization_config's old name)
    config = {k: v for k, v in plan.source.config.items() if k != "compression_config"}
    if (quantization := plan.quantization_config()) is None:
        config.pop("quantization_config", None)
        if plan.options.dtype:  # dequantized to another dtype: transformers loads the model in the one named here
            config |= {k: DTYPES[plan.options.dtype][1] for k in CONFIG_DTYPE_KEYS if k in config}
    else:
        config["quantization_config"] = quantization
    write_atomic(out_dir / "config.json", json_bytes(config))
    manifest.mark_complete(plan)
    # every shard is final: records of units are left only by a run that stopped before removing one
    for record in (out_dir / WORK_DIR).glob("*" + RECORD_SUFFIX):
        record.unlink(missing_ok=True)
    fsync_dir(out_dir)


def check_shards(plan: Plan, out_dir: Path) -> None:
    """Every planned shard present, of the planned size, starting with the planned header bytes."""
    if missing := [s for s in plan.shards if not (out_dir / s.name).is_file()]:
        raise FP8ConvertError(
            f"{out_dir / missing[0].name}: missing ({len(missing)} of {len(plan.shards)} "
            "shards); run the workers that own them (the same quantize command) first"
        )
    for shard in plan.shards:
        path = out_dir / shard.name
        if (size := path.stat().st_size) != shard.size:
            raise FP8ConvertError(
                f"{path}: {size} bytes, the plan says {shard.size} (incomplete or not from this "
                "plan); remove it and rerun the quantize command to rewrite it"
            )
        with open(path, "rb") as f:
            if f.read(len(shard.header)) != shard.header:
                raise FP8ConvertError(
                    f"{path}: its header differs from the plan's (not written by this conversion); "
                    "remove it and rerun the quantize command to rewrite it"
                )


def check_output_complete(out: Path) -> dict:
    """The output's config.json; the push is refused for anything but a finished conversion: a complete
    manifest (when present), a quantization_config (unless dequantized), every shard the index names."""
    if not out.is_dir():
        raise FP8ConvertError(f"{out}: no such output directory")
    try:
        state = Manifest(out).read()
    except FP8ConvertError as e:
        raise FP8ConvertError(f"{e}; refusing to push") from e
    finish = "rerun the same quantize command to finish it before you push"
    if state is not None and not state.get("complete"):
        raise FP8ConvertError(f"{out}: the conversion is not complete (manifest says so); {finish}")
    for name in ("config.json", INDEX_NAME):
        if not (out / name).is_file():
            raise FP8ConvertError(f"{out}: no {name}, so the conversion is not complete; {finish}")
    try:
        config = json.loads((out / "config.json").read_text())
    except ValueError as e:
        raise FP8ConvertError(f"{out}/config.json: unreadable ({e}); refusing to push") from e
    shards = index_files(parse_index((out / INDEX_NAME).read_bytes(), str(out / INDEX_NAME)))
    dequantized = bool((state or {}).get("dequantize"))
    if not isinstance(config, dict) or ("quantization_config" not in config and not dequantized):
        raise FP8ConvertError(f"{out}/config.json: has no quantization_config; not an FP8 output")
    for name in shards:
        if not (out / name).is_file():
            raise FP8ConvertError(f"{out / name}: missing (the index names it); refusing to push")
        try:
            read_header(str(out / name), name)  # a truncated or padded shard fails here
        except FP8ConvertError as e:
            raise FP8ConvertError(f"{e}; refusing to push") from e  # the error names the shard's path
    return config
