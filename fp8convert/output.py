"""The output directory: refusing to clobber, the manifest that makes runs resumable, and finalize.

An output is complete when config.json and the index exist (written last, after every shard was
fsynced and renamed). `.fp8convert/manifest.json` records the plan's fingerprint. A shard only ever
gets its final name by an atomic rename after fsync, so a final-named shard of the planned size is
finished: rerunning the same command (or another worker) skips it and continues with the rest.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path

from .errors import FP8ConvertError, PlanMismatchError
from .card import make_card, read_source_card
from .plan import Plan
from .source import INDEX_NAME
from .writeback import fsync_dir

WORK_DIR = ".fp8convert"
MANIFEST = "manifest.json"


def write_atomic(path: Path, data: bytes) -> None:
    """Write under a temporary name, fsync, rename: `path` is never seen half-written, whenever the
    process dies. A failure (disk full) is one resumable error."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise FP8ConvertError(f"{path}: cannot write ({e.strerror}); rerun the same command to resume once "
                              "the problem is fixed") from e


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


class Manifest:
    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / WORK_DIR / MANIFEST

    def read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise FP8ConvertError(f"{self.path}: unreadable ({e}); remove it or pass --overwrite") from e

    def write(self, data: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json_bytes(data))


def is_inside(child: Path, parent: Path) -> bool:
    child, parent = child.resolve(), parent.resolve()
    return child == parent or parent in child.parents


def prepare_output(plan: Plan, out_dir: Path, overwrite: bool) -> tuple[set[int], bool]:
    """Make OUT ready. Returns (indices of shards finished by an earlier run of this plan, complete?)."""
    out_dir = Path(out_dir)
    src = plan.source.root
    if plan.source.fetcher is None and is_inside(out_dir, src):  # streamed shards live in OUT/.fp8convert
        raise FP8ConvertError(f"{out_dir}: the output must not be the source directory or inside it")
    if plan.source.fetcher is None and is_inside(src, out_dir):
        raise FP8ConvertError(f"{out_dir}: the output must not contain the source directory {src}")
    if out_dir.exists() and not out_dir.is_dir():
        raise FP8ConvertError(f"{out_dir}: exists and is not a directory")
    manifest = Manifest(out_dir)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not killed_before_manifest(out_dir):
        state = manifest.read()
        if overwrite:
            clear_directory(out_dir)
        elif state is None:
            raise FP8ConvertError(f"{out_dir}: already holds files that fp8convert did not write; "
                                  "choose an empty directory or pass --overwrite")
        elif state.get("fingerprint") != plan.fingerprint:
            raise PlanMismatchError(f"{out_dir}: holds a conversion with a different plan ({plan_change(state, plan)}); "
                                    "rerun the original command to resume it, or pass --overwrite to replace it")
        else:
            done = finished_shards(plan, out_dir)
            return done, bool(state.get("complete")) and len(done) == len(plan.shards) \
                and (out_dir / "config.json").is_file() and (out_dir / INDEX_NAME).is_file()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / WORK_DIR).mkdir(exist_ok=True)
    except OSError as e:
        raise FP8ConvertError(f"{out_dir}: cannot create ({e.strerror})") from e
    if not os.access(out_dir, os.W_OK):
        raise FP8ConvertError(f"{out_dir}: not writable")
    create_manifest(manifest, plan)
    return set(), False


def create_manifest(manifest: Manifest, plan: Plan) -> None:
    """The manifest of a new output. Workers started together on an empty OUT all get here: each writes
    its own temporary file and renames it into place (same plan, same bytes: whichever lands last is
    the same manifest), checks that the manifest in place records its plan, and removes temporary
    files left by runs killed before their rename. A worker whose temporary file another removed that
    way finds the other's manifest in place."""
    path = manifest.path
    tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        for _ in range(3):
            try:
                with open(tmp, "wb") as f:
                    f.write(json_bytes(new_manifest(plan)))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
                break
            except FileNotFoundError:
                if path.is_file():
                    break
        fsync_dir(path.parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise FP8ConvertError(f"{path}: cannot write ({e.strerror})") from e
    if (manifest.read() or {}).get("fingerprint") != plan.fingerprint:
        raise PlanMismatchError(f"{path.parent.parent}: another run started a conversion with a different plan "
                                "in it at the same time")
    for leftover in path.parent.glob(f".{MANIFEST}*.tmp"):
        with contextlib.suppress(OSError):
            leftover.unlink()


def killed_before_manifest(out_dir: Path) -> bool:
    """OUT holds only the work directory, without a manifest: what a run killed before its manifest
    existed leaves, or what a worker started a moment earlier has made so far (several workers start
    together on an empty OUT). Such a directory is ours and empty in every way that matters."""
    work = out_dir / WORK_DIR
    return [p.name for p in out_dir.iterdir()] == [WORK_DIR] and work.is_dir() and not work.is_symlink() \
        and not (work / MANIFEST).exists()


def plan_change(state: dict, plan: Plan) -> str:
    """What differs between the recorded run and this one, as far as the manifest can tell."""
    now = new_manifest(plan)
    diffs = [f"{key} was {state.get(key)!r}, now {now[key]!r}" for key in ("source", "scheme", "format", "shards")
             if state.get(key) != now[key]]
    return "; ".join(diffs) or "same source, scheme and format: the source's tensors or config, --ignore, " \
                               "--max-shard-size or the fp8convert version changed"


def finished_shards(plan: Plan, out_dir: Path) -> set[int]:
    done = set()
    for shard in plan.shards:
        path = Path(out_dir) / shard.name
        if path.is_file() and path.stat().st_size == shard.size:
            done.add(shard.index)
    return done


def new_manifest(plan: Plan) -> dict:
    """Also records what `finalize_output` needs to rebuild the plan: the source (a local directory's
    absolute path; a Hub repo's commit), scheme, format, ignore patterns and shard size."""
    source, root = plan.source, Path(plan.source.root)
    local = source.fetcher is None and source.label == str(root)  # open_local labels a directory by its path
    revision = getattr(source, "revision", None)
    if revision is None and not local and root.parent.name == "snapshots":
        revision = root.name  # downloaded into the huggingface_hub cache: the snapshot directory is the commit
    return {"tool": "fp8convert", "fingerprint": plan.fingerprint, "source": source.label,
            "source_path": str(root.resolve()) if local else None, "revision": None if local else revision,
            "scheme": plan.options.scheme, "format": plan.options.format, "ignore": list(plan.options.ignore),
            "max_shard_size": plan.options.max_shard_size, "shards": len(plan.shards), "complete": False}


def clear_directory(out_dir: Path) -> None:
    for entry in out_dir.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def finalize(plan: Plan, out_dir: Path, extra: dict | None = None) -> None:
    """Copy side files, then write the index and config.json last: their presence means complete."""
    out_dir = Path(out_dir)
    missing = [s.name for s in plan.shards if s.index not in finished_shards(plan, out_dir)]
    if missing:
        raise FP8ConvertError(f"{out_dir / missing[0]}: missing or incomplete ({len(missing)} of "
                              f"{len(plan.shards)} shards); rerun the conversion to finish it")
    for name in plan.source.copy_files:
        write_atomic(out_dir / name, (plan.source.root / name).read_bytes())  # side files are small
    write_atomic(out_dir / "README.md", make_card(plan, read_source_card(plan.source.root)).encode())
    weight_map = {}
    for shard in plan.shards:
        weight_map.update({t: shard.name for t in shard.tensors})
    index = {"metadata": {"total_size": sum(t.nbytes for s in plan.shards for t in s.tensors.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    write_atomic(out_dir / INDEX_NAME, json_bytes(index))
    config = dict(plan.source.config)
    config["quantization_config"] = plan.quantization_config()
    write_atomic(out_dir / "config.json", json_bytes(config))
    state = Manifest(out_dir).read() or new_manifest(plan)
    state["complete"] = True
    state.update(extra or {})
    Manifest(out_dir).write(state)
    fsync_dir(out_dir)


def check_shards(the_plan: Plan, out_dir: Path) -> None:
    """Every planned shard present, of the planned size, starting with the planned header bytes."""
    out_dir = Path(out_dir)
    missing = [s for s in the_plan.shards if not (out_dir / s.name).is_file()]
    if missing:
        raise FP8ConvertError(f"{out_dir / missing[0].name}: missing ({len(missing)} of {len(the_plan.shards)} "
                              "shards); run the workers that own them (the same quantize command) first")
    for shard in the_plan.shards:
        path = out_dir / shard.name
        size = path.stat().st_size
        if size != shard.size:
            raise FP8ConvertError(f"{path}: {size} bytes, the plan says {shard.size} (incomplete or not from this "
                                  "plan); remove it and rerun the quantize command to rewrite it")
        with open(path, "rb") as f:
            head = f.read(len(shard.header))
        if head != shard.header:
            raise FP8ConvertError(f"{path}: its header differs from the plan's (not written by this conversion); "
                                  "remove it and rerun the quantize command to rewrite it")
