"""OUT/.fp8convert/manifest.json: what this output is a conversion of, so a rerun can resume it, a worker
join it and `finalize` rebuild its plan. Besides the plan's fingerprint (names, shapes and offsets, not
values) it records the source's bytes' identity and what the fingerprint was made of, so a refusal can say
what changed."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import time
from pathlib import Path

from .._version import __version__
from ..errors import FP8ConvertError, PlanMismatchError
from ..files import fsync_dir, json_bytes, replace_with, write_atomic
from ..plan.plan import Plan
from ..safetensors_io import INDEX_NAME
from ..source.checkpoint import Source
from ..units import size_text

WORK_DIR = ".fp8convert"  # OUT's work folder: never uploaded, never part of the result
MANIFEST = "manifest.json"
DOWNLOAD_DIR = "download"  # in the work folder: source shards of --stream-download


class Manifest:
    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / WORK_DIR / MANIFEST

    def read(self) -> dict | None:
        try:
            state = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise FP8ConvertError(f"{self.path}: unreadable ({e})") from e
        if not isinstance(state, dict):
            raise FP8ConvertError(f"{self.path}: not a JSON object")
        return state

    def claim(self, plan: Plan, base_model: str | None) -> None:
        """Make OUT this conversion's once every check before writing has passed, so that a refused run
        leaves no claim behind. A resumed run's manifest (and its `base_model`) stands."""
        if not self.path.exists():
            self._create(json_bytes(new_manifest(plan, base_model)))
        if (self.read() or {}).get("fingerprint") != plan.fingerprint:
            raise PlanMismatchError(
                f"{self.path.parent.parent}: another run started a conversion with a different plan in it at the "
                "same time"
            )

    def _create(self, data: bytes) -> None:
        """Workers started together on an empty OUT all get here: each renames its own temporary file into
        place (same plan, same bytes) and removes those left by runs killed before their rename. A worker
        whose temporary file another removed that way finds the other's manifest in place."""
        path = self.path
        tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            for _ in range(3):
                try:
                    replace_with(path, data, tmp)
                    break
                except FileNotFoundError:
                    if path.is_file():
                        break
            fsync_dir(path.parent)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise FP8ConvertError(f"{path}: cannot write ({e.strerror})") from e
        for leftover in path.parent.glob(f".{MANIFEST}*.tmp"):
            with contextlib.suppress(OSError):
                leftover.unlink()

    def mark_complete(self, plan: Plan) -> None:
        state = self.read() or new_manifest(plan)
        write_atomic(self.path, json_bytes({**state, "complete": True}))


def source_files(source: Source) -> dict | None:
    """Each local shard's size and modification time (None: gone), which say that the source's bytes are
    the ones a recorded run read; None for a Hub source, whose commit says it."""
    if source.revision is not None:
        return None
    files = {}
    for name in source.files:
        try:
            st = os.stat(source.root / name)
            files[name] = [st.st_size, st.st_mtime_ns]
        except OSError:
            files[name] = None
    return files


def new_manifest(plan: Plan, base_model: str | None = None) -> dict:
    """`base_model` is recorded for the model card: finalize may run in another process."""
    source = plan.source
    layout: dict[str, list] = {}  # per shard file, its tensors' names, dtypes, shapes and offsets
    for t in source.tensors:
        layout.setdefault(t.file, []).append([t.name, t.dtype, list(t.shape), t.offset])
    return {
        "tool": "fp8convert",
        "version": __version__,
        "fingerprint": plan.fingerprint,
        "source": source.label,
        "source_path": str(source.root.resolve()) if source.revision is None else None,
        "revision": source.revision,
        "source_files": source_files(source),
        **plan.options.record(),  # what finalize_output rebuilds the plan from (Options.from_record)
        "shards": len(plan.shards),
        "config": source.config,
        "tensor_layout": {f: hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16] for f, rows in layout.items()},
        # every name a conversion of `plan` writes at OUT's top level (besides the work folder)
        "outputs": sorted({*(s.name for s in plan.shards), INDEX_NAME, "config.json", "README.md", *source.copy_files}),
        "base_model": base_model,
        "complete": False,
    }


# The recorded options a plan change names, in the order it lists them, as the user spells them
FLAG_OPTIONS = ("scheme", "format", "ignore", "max_shard_size", "scale_format")
OPTION_NAMES = {"source": "source"} | {k: "--" + k.replace("_", "-") for k in FLAG_OPTIONS}
OPTION_NAMES |= {
    "dequantize": "dequantize",
    "dtype": "--dtype",
    "version": "fp8convert version",
    "recipe": "the recipe",
}


def option_value(key: str, value) -> str:
    """A recorded option's value as the user would type it: a shard size as '50MB', not its bytes, a
    recipe as its PATTERN=SCHEME rules (recorded only when set: absent means none)."""
    if key == "recipe":
        return repr(" ".join(f"{pattern}={scheme}" for pattern, scheme in value or ()) or "none")
    return size_text(value) if key == "max_shard_size" and isinstance(value, int) else repr(value)


def plan_change(state: dict, plan: Plan) -> str:
    """What differs between the recorded run and this one: the options, else the source's layout."""
    now = new_manifest(plan)
    diffs = [
        f"{OPTION_NAMES[key]} was {option_value(key, was)}, now {option_value(key, is_)}"
        for key in OPTION_NAMES
        if (key in state or key == "recipe") and (was := state.get(key)) != (is_ := now.get(key))
    ]
    if not diffs:  # the config.json keys and shards that differ (an older manifest records neither)
        was = state.get("config")
        if isinstance(was, dict) and (keys := differing(was, now["config"])):
            shown = ", ".join(
                f"{k} was {json.dumps(was.get(k))}, now {json.dumps(now['config'].get(k))}" for k in keys[:3]
            )
            more = f" and {len(keys) - 3} more keys" if len(keys) > 3 else ""
            diffs.append(f"the source's config.json changed ({shown}{more})")
        was = state.get("tensor_layout")
        if isinstance(was, dict) and (files := differing(was, now["tensor_layout"])):
            changed = [
                f + (" (new)" if f not in was else " (gone)" if f not in now["tensor_layout"] else "") for f in files
            ]
            diffs.append(f"the source's tensors (names, dtypes, shapes or offsets) changed in {', '.join(changed)}")
    return "; ".join(diffs) or "same source and options: the source's tensors or config.json changed"


def differing(was: dict, now: dict) -> list[str]:
    return sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))


def source_change(state: dict, source: Source) -> str | None:
    """How the source's bytes differ from what the recorded run read; None when they do not (or the manifest
    does not record them)."""
    if source.revision is not None:
        was = state.get("revision")
        if was and was != source.revision:
            return f"{source.label} is now at commit {source.revision[:12]}, the output was started from {was[:12]}"
        return None
    recorded = state.get("source_files")
    for name, stat in (source_files(source) if recorded else {}).items():
        if recorded.get(name) != stat:
            if stat is None:
                return f"{source.root / name} is gone"
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stat[1] / 1e9))
            return f"{source.root / name} changed since the output was started (modified {when})"
    return None
