"""The output directory: refusing to clobber, resuming, and finishing.

A shard gets its final name only by a rename after fsync, so a final-named shard of the planned size is
finished: a rerun (or another worker) skips it. config.json and the index are written last, so their
presence means complete. A manifest whose run wrote nothing yet claims nothing: a run of another plan
that writes the whole output starts afresh there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import FP8ConvertError, PlanMismatchError
from ..plan.plan import Plan
from ..run.writeback import fsync_dir
from ..safetensors_io import INDEX_NAME, read_header
from ..source.checkpoint import index_files, parse_index
from .card import make_card, read_source_card
from .files import json_bytes, write_atomic
from .lock import OutputLock
from .manifest import WORK_DIR, Manifest, plan_change, source_change
from .ownership import (
    empty_work_folder,
    foreign_entries,
    killed_before_manifest,
    refuse_foreign,
    replace_advice,
    replace_output,
)
from .partial import RECORD_SUFFIX, remove_records


def is_inside(child: Path, parent: Path) -> bool:
    child, parent = child.resolve(), parent.resolve()
    return child == parent or parent in child.parents


def prepare_output(
    plan: Plan, out_dir: Path, overwrite: bool, streamed: bool = False, lock: OutputLock | None = None
) -> tuple[set[int], bool]:
    """Make OUT ready, claiming nothing yet (Manifest.claim, once the run can start). Returns (indices of
    shards finished by an earlier run of this plan, complete?). `streamed`: OUT's work folder holds the
    source's shards. `lock` is taken once OUT is known to be fp8convert's, before anything in it is read
    or changed; the caller holds it for the rest of the run."""
    out_dir = Path(out_dir)
    check_placement(plan, out_dir, streamed)
    manifest = Manifest(out_dir)
    # A folder with fp8convert's manifest is resumed, files the user added to it left alone; only
    # replacing it (--overwrite) needs every file in it to be fp8convert's.
    occupied = out_dir.is_dir() and any(out_dir.iterdir()) and not killed_before_manifest(out_dir)
    if occupied and (overwrite or read_for_resume(manifest, out_dir) is None) and (foreign := foreign_entries(out_dir)):
        refuse_foreign(out_dir, foreign, overwrite)
    if lock is not None:
        lock.acquire()
    if occupied and overwrite:
        replace_output(out_dir)
    elif occupied and (state := read_for_resume(manifest, out_dir)) is not None:
        try:
            check_same_conversion(state, plan, out_dir)
        except PlanMismatchError:
            # Another conversion's, but its run wrote nothing to keep and no other run writes here (the
            # lock is this run's alone): start afresh (files the user added stay).
            if not (lock is not None and lock.count == 1 and wrote_nothing(state, out_dir)):
                raise
            empty_work_folder(out_dir)
        else:
            done = finished_shards(plan, out_dir)
            return done, bool(state.get("complete")) and len(done) == len(plan.shards) and (
                out_dir / "config.json"
            ).is_file() and (out_dir / INDEX_NAME).is_file()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / WORK_DIR).mkdir(exist_ok=True)
    except OSError as e:
        raise FP8ConvertError(f"{out_dir}: cannot create ({e.strerror})") from e
    if not os.access(out_dir, os.W_OK):
        raise FP8ConvertError(f"{out_dir}: not writable")
    return set(), False


def wrote_nothing(state: dict, out_dir: Path) -> bool:
    """Whether the run that wrote this manifest left nothing to keep (no output, no unit of a partial shard)."""
    outputs = state.get("outputs")
    return (
        isinstance(outputs, list)
        and not any((out_dir / name).exists() for name in outputs)
        and not any((out_dir / WORK_DIR).glob("*" + RECORD_SUFFIX))
    )


def read_for_resume(manifest: Manifest, out_dir: Path) -> dict | None:
    try:
        return manifest.read()
    except FP8ConvertError as e:
        raise FP8ConvertError(
            f"{e}: {out_dir} cannot be resumed, and fp8convert cannot tell its files there from "
            "others' to replace them; delete the folder yourself or choose another output "
            "directory"
        ) from e


def check_placement(plan: Plan, out_dir: Path, streamed: bool) -> None:
    src = plan.source.root
    if not streamed and is_inside(out_dir, src):
        raise FP8ConvertError(f"{out_dir}: the output must not be the source directory or inside it")
    if not streamed and is_inside(src, out_dir):
        raise FP8ConvertError(f"{out_dir}: the output must not contain the source directory {src}")
    if out_dir.exists() and not out_dir.is_dir():
        raise FP8ConvertError(f"{out_dir}: exists and is not a directory")


def check_same_conversion(state: dict, plan: Plan, out_dir: Path) -> None:
    """OUT holds a run of this very conversion: same plan, and the same source bytes."""
    if state.get("fingerprint") != plan.fingerprint:
        raise PlanMismatchError(
            f"{out_dir}: holds a conversion with a different plan ({plan_change(state, plan)}); "
            "rerun the original command to resume it, or " + replace_advice(out_dir, "pass --overwrite to replace it")
        )
    changed = source_change(state, plan.source)
    if changed:
        how = (
            "" if plan.source.revision else "; fp8convert records each file's size and modification time, not its bytes"
        )
        raise PlanMismatchError(
            f"{out_dir}: was started from another state of the source ({changed}{how}); "
            + replace_advice(out_dir, "pass --overwrite to start again from the source as it is now")
        )


def finished_shards(plan: Plan, out_dir: Path) -> set[int]:
    return {s.index for s in plan.shards if (p := Path(out_dir) / s.name).is_file() and p.stat().st_size == s.size}


def finalize(plan: Plan, out_dir: Path) -> None:
    """Copy side files, then write the card, the index and config.json last: their presence means complete."""
    out_dir = Path(out_dir)
    missing = [s.name for s in plan.shards if s.index not in finished_shards(plan, out_dir)]
    if missing:
        raise FP8ConvertError(
            f"{out_dir / missing[0]}: missing or incomplete ({len(missing)} of "
            f"{len(plan.shards)} shards); rerun the conversion to finish it"
        )
    for name in plan.source.copy_files:
        write_atomic(out_dir / name, (plan.source.root / name).read_bytes())  # side files are small
    card = make_card(
        plan, read_source_card(plan.source.root), base_model=(Manifest(out_dir).read() or {}).get("base_model")
    )
    write_atomic(out_dir / "README.md", card.encode())
    write_atomic(out_dir / INDEX_NAME, json_bytes(index_of(plan)))
    write_atomic(out_dir / "config.json", json_bytes(output_config(plan)))
    Manifest(out_dir).mark_complete(plan)
    remove_records(out_dir / WORK_DIR)  # of a shard renamed by a run that stopped before removing its record
    fsync_dir(out_dir)


def output_config(plan: Plan) -> dict:
    """The source's config.json (key order kept) with the output's quantization_config (none when
    dequantized) in place of the source's own, and without the old name compression_config."""
    config = dict(plan.source.config)
    config.pop("compression_config", None)
    quantization = plan.quantization_config()
    if quantization is None:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = quantization
    return config


def index_of(plan: Plan) -> dict:
    weight_map = {name: shard.name for shard in plan.shards for name in shard.tensors}
    return {
        "metadata": {"total_size": sum(t.nbytes for s in plan.shards for t in s.tensors.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }


def check_shards(the_plan: Plan, out_dir: Path) -> None:
    """Every planned shard present, of the planned size, starting with the planned header bytes."""
    out_dir = Path(out_dir)
    missing = [s for s in the_plan.shards if not (out_dir / s.name).is_file()]
    if missing:
        raise FP8ConvertError(
            f"{out_dir / missing[0].name}: missing ({len(missing)} of {len(the_plan.shards)} "
            "shards); run the workers that own them (the same quantize command) first"
        )
    for shard in the_plan.shards:
        path = out_dir / shard.name
        size = path.stat().st_size
        if size != shard.size:
            raise FP8ConvertError(
                f"{path}: {size} bytes, the plan says {shard.size} (incomplete or not from this "
                "plan); remove it and rerun the quantize command to rewrite it"
            )
        with open(path, "rb") as f:
            head = f.read(len(shard.header))
        if head != shard.header:
            raise FP8ConvertError(
                f"{path}: its header differs from the plan's (not written by this conversion); "
                "remove it and rerun the quantize command to rewrite it"
            )


def check_output_complete(out: str | Path, action: str = "push") -> dict:
    """Refuse (to `action`) anything but a finished conversion: a complete manifest (when present),
    config.json with a quantization_config (unless dequantized), the index and every shard it names,
    whole. Returns the output's config.json."""
    out = Path(out)
    if not out.is_dir():
        raise FP8ConvertError(f"{out}: no such output directory")
    try:
        state = Manifest(out).read()
    except FP8ConvertError as e:
        raise FP8ConvertError(f"{e}; refusing to {action}") from e
    if state is not None and not state.get("complete"):
        raise FP8ConvertError(
            f"{out}: the conversion is not complete (manifest says so); rerun the same "
            f"quantize command to finish it before you {action}"
        )
    for name in ("config.json", INDEX_NAME):
        if not (out / name).is_file():
            raise FP8ConvertError(
                f"{out}: no {name}, so the conversion is not complete; rerun the same quantize "
                f"command to finish it before you {action}"
            )
    try:
        config = json.loads((out / "config.json").read_text())
        shards = index_files(parse_index((out / INDEX_NAME).read_bytes(), str(out / INDEX_NAME)))
    except ValueError as e:
        raise FP8ConvertError(f"{out}/config.json: unreadable ({e}); refusing to {action}") from e
    dequantized = bool((state or {}).get("dequantize"))
    if not isinstance(config, dict) or ("quantization_config" not in config and not dequantized):
        raise FP8ConvertError(f"{out}/config.json: has no quantization_config; not an FP8 output")
    for name in shards:
        if not (out / name).is_file():
            raise FP8ConvertError(f"{out / name}: missing (the index names it); refusing to {action}")
        try:
            read_header(str(out / name), name)  # a truncated or padded shard fails here
        except FP8ConvertError as e:
            raise FP8ConvertError(f"{e}; refusing to {action}") from e  # the error names the shard's path
    return config
