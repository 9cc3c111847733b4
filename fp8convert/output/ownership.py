"""Whose files OUT holds: fp8convert may replace (`--overwrite`) only what it wrote itself.

The manifest records the names a conversion writes at OUT's top level; anything else there (the user's
own files) is foreign and never deleted: the command that would replace OUT is refused instead.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import FP8ConvertError
from .lock import is_lock_file
from .manifest import MANIFEST, WORK_DIR, Manifest

NAMED = 3  # foreign entries named in a refusal; the rest are counted


def killed_before_manifest(out_dir: Path) -> bool:
    """OUT holds only the work folder, without a manifest: left by a run killed before its manifest
    existed, or made by a worker started a moment earlier. Ours, and empty in every way that matters."""
    work = Path(out_dir) / WORK_DIR
    return (
        [p.name for p in Path(out_dir).iterdir()] == [WORK_DIR]
        and work.is_dir()
        and not work.is_symlink()
        and not (work / MANIFEST).exists()
    )


def foreign_entries(out_dir: Path) -> list[str]:
    """OUT's top-level entries that fp8convert did not write, sorted (directories end in '/'). A manifest
    that cannot be read, or that lists no outputs, cannot tell fp8convert's files from others': refused."""
    out_dir = Path(out_dir)
    entries = {p.name: p for p in out_dir.iterdir()} if out_dir.is_dir() else {}
    if not entries or killed_before_manifest(out_dir):
        return []
    manifest = Manifest(out_dir)
    ours: set[str] = set()
    if manifest.path.is_file():
        try:
            recorded = (manifest.read() or {}).get("outputs")
        except FP8ConvertError as e:
            raise FP8ConvertError(
                f"{e}: fp8convert cannot tell its files in {out_dir} from others', so it "
                "replaces nothing there; delete the folder yourself or choose another output "
                "directory"
            ) from e
        if not isinstance(recorded, list):
            raise FP8ConvertError(
                f"{manifest.path}: does not list the files fp8convert wrote (an older output), so "
                f"it replaces nothing in {out_dir}; delete the folder yourself or choose another "
                "output directory"
            )
        ours = set(recorded)
    ours.add(WORK_DIR)
    return sorted(
        name + ("/" if path.is_dir() and not path.is_symlink() else "")
        for name, path in entries.items()
        if name not in ours
    )


def describe(names: list[str]) -> str:
    """'a, b, c and 4 more'."""
    shown = ", ".join(names[:NAMED])
    return shown + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")


def refuse_foreign(out_dir: Path, foreign: list[str], overwrite: bool) -> None:
    """The one refusal for an OUT holding someone else's files (never suggesting --overwrite: it cannot help)."""
    why = " (--overwrite replaces only an earlier fp8convert output)" if overwrite else ""
    raise FP8ConvertError(
        f"{out_dir}: holds files fp8convert did not write ({describe(foreign)}); choose an "
        f"empty or new output directory{why}"
    )


def replace_output(out_dir: Path) -> None:
    """Delete an earlier fp8convert output; refused, deleting nothing, when OUT holds anything else."""
    out_dir = Path(out_dir)
    foreign = foreign_entries(out_dir)
    if foreign:
        refuse_foreign(out_dir, foreign, overwrite=True)
    work = out_dir / WORK_DIR
    remove([e for e in out_dir.iterdir() if e != work])
    empty_work_folder(out_dir)


def empty_work_folder(out_dir: Path) -> None:
    """Delete what OUT's work folder holds but the lock files, which hold this run's lock."""
    work = Path(out_dir) / WORK_DIR
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


def replace_advice(out_dir: Path, what: str = "pass --overwrite to replace it") -> str:
    """How to start OUT again: `what` when --overwrite may replace it, else what stands in the way."""
    foreign = foreign_entries(out_dir)
    if foreign:
        return f"move {describe(foreign)} out of {out_dir} or choose another output directory"
    return what
