#!/usr/bin/env python3
"""Output bytes before and after a change: convert a set of checkpoints with every scheme/format pair
through the CLI and record a SHA-256 of every output file (the work folder `.fp8convert/` aside).

    python3 scripts/output_digest.py --work /tmp/digest --save before.json          # on the old commit
    python3 scripts/output_digest.py --work /tmp/digest --compare before.json       # on the new one

Checkpoints: the test suite's tiny models (tests/support/tiny_models.py), the demo model, and with --bench the
2-layer benchmark checkpoints of scripts/anchor/make_ckpt.py (a few GB each; built once and kept in
--work). The model cards and refusal lines name paths under --work; they are hashed with that folder
written as `<work>`, so digests made in two folders compare. Exits 1 when --compare finds a difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMBOS = [
    ("tensor", "compressed-tensors"),
    ("channel", "compressed-tensors"),
    ("block", "compressed-tensors"),
    ("tensor", "fp8"),
    ("block", "fp8"),
    ("mxfp8", "compressed-tensors"),
    ("nvfp4a16", "compressed-tensors"),
    ("mxfp4a16", "compressed-tensors"),
]


def build_sources(work: Path, bench: bool) -> dict[str, Path]:
    sys.path.insert(0, str(REPO / "tests" / "support"))
    from tiny_models import KINDS, make_model

    sources = {}
    for kind in KINDS:
        path = work / "src" / kind
        if not (path / "config.json").is_file():
            make_model(kind, path)
        sources[kind] = path
    demo = work / "src" / "demo"
    if not (demo / "config.json").is_file():
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from fp8convert.demo import make_demo_model; make_demo_model(sys.argv[1])",
                str(demo),
            ],
            check=True,
        )
    sources["demo"] = demo
    if bench:
        for name, kind in (("moe2", "moe"), ("dense2", "dense")):
            path = work / "src" / name
            if not (path / "config.json").is_file():
                subprocess.run(
                    [
                        sys.executable,
                        str(REPO / "scripts" / "anchor" / "make_ckpt.py"),
                        str(path),
                        "--kind",
                        kind,
                        "--layers",
                        "2",
                        "--shard-gb",
                        "2",
                    ],
                    check=True,
                )
            sources[name] = path
    return sources


def digest_dir(path: Path, work: Path) -> dict[str, str]:
    out = {}
    for f in sorted(path.rglob("*")):
        rel = f.relative_to(path).as_posix()
        if f.is_file() and not rel.startswith(".fp8convert"):
            h = hashlib.sha256()
            if rel == "README.md":  # the card names the source and output paths
                h.update(f.read_bytes().replace(f"{work}/".encode(), b"<work>/"))
            else:
                with open(f, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 24), b""):
                        h.update(block)
            out[rel] = h.hexdigest()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--bench", action="store_true", help="also the 2-layer benchmark checkpoints (GBs)")
    ap.add_argument("--save", type=Path)
    ap.add_argument("--compare", type=Path)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    args.work = args.work.resolve()  # the path the cards and messages name, replaced whole
    results = {}
    for name, src in build_sources(args.work, args.bench).items():
        for scheme, fmt in COMBOS:
            key = f"{name}/{scheme}/{fmt}"
            out = args.work / "out" / f"{name}-{scheme}-{fmt}"
            run = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "fp8convert",
                    "quantize",
                    str(src),
                    str(out),
                    "--scheme",
                    scheme,
                    "--format",
                    fmt,
                    "--device",
                    args.device,
                    "--overwrite",
                    "-q",
                ],
                capture_output=True,
                text=True,
            )
            if run.returncode:
                last = (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1]
                results[key] = {"error": last.replace(f"{args.work}/", "<work>/")}
            else:
                results[key] = digest_dir(out, args.work)
            print(
                f"{key}: {len(results[key])} files" if run.returncode == 0 else f"{key}: {results[key]['error']}",
                flush=True,
            )
    if args.save:
        args.save.write_text(json.dumps(results, indent=1, sort_keys=True))
    if args.compare:
        before = json.loads(args.compare.read_text())
        diffs = [
            f"{key}: {sorted(set(before.get(key, {}).items()) ^ set(results.get(key, {}).items()))[:4]}"
            for key in sorted(set(before) | set(results))
            if before.get(key) != results.get(key)
        ]
        print("\n".join(diffs) if diffs else f"identical: {len(results)} conversions")
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
