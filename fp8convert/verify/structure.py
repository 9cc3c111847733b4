"""The output's files, from headers alone (no tensor data, no torch): the index against the shards'
headers, config.json against the source's, the manifest and side files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import FP8ConvertError
from ..formats import QuantizationConfig, read_quantization_config
from ..output.manifest import Manifest
from ..safetensors_io import INDEX_NAME, TensorInfo, read_header
from ..source.checkpoint import Source, index_files, parse_index
from .report import VerifyReport


@dataclass
class OutputLayout:
    tensors: dict[str, TensorInfo]  # every output tensor (its .file: where it is)
    placed_in: dict[str, str]  # tensor -> file, as the index says
    unreadable: set[str]  # shard files whose header could not be read


def read_output_layout(out: Path, report: VerifyReport) -> OutputLayout:
    """Every output tensor and where it is, checking the index against the shards' headers."""
    index_path = out / INDEX_NAME
    layout = OutputLayout({}, {}, set())
    if index_path.is_file():
        try:
            weight_map = parse_index(index_path.read_bytes(), INDEX_NAME)
            index = json.loads(index_path.read_text())
            files = index_files(weight_map)
        except FP8ConvertError as e:
            report.fail(INDEX_NAME, str(e).removeprefix(f"{INDEX_NAME}: "))
            return layout
        layout.placed_in = dict(weight_map)
    elif (out / "model.safetensors").is_file():
        index, weight_map, files = None, None, ["model.safetensors"]
    else:
        report.fail(str(out), f"no {INDEX_NAME} (or model.safetensors): the output is incomplete")
        return layout
    total = 0
    tensors = layout.tensors
    for file in files:
        path = out / file
        if not path.is_file():
            report.fail(INDEX_NAME, f"names {file}, which does not exist")
            layout.unreadable.add(file)
            continue
        try:
            header, _ = read_header(str(path), file)
        except FP8ConvertError as e:
            report.fail(file, str(e).removeprefix(f"{path}: "))
            layout.unreadable.add(file)
            continue
        for name, info in header.items():
            total += info.nbytes
            if name in tensors:
                report.fail(f"tensor {name}", f"appears twice: in {tensors[name].file} and {file}")
            elif weight_map is not None and weight_map.get(name) != file:
                report.fail(
                    file,
                    f"holds tensor {name}, which {INDEX_NAME} "
                    + (f"places in {weight_map[name]}" if name in weight_map else "does not list"),
                )
            tensors[name] = info
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors and file not in layout.unreadable:
                report.fail(INDEX_NAME, f"names tensor {name} in {file}, but {file} does not hold it")
        declared = (index.get("metadata") or {}).get("total_size") if isinstance(index, dict) else None
        if declared is not None and declared != total and not layout.unreadable:
            report.fail(INDEX_NAME, f"metadata.total_size is {declared}, the shards hold {total} bytes")
        stray = sorted(p.name for p in out.glob("*.safetensors") if p.name not in files)
        if stray:
            report.warnings.append(f"{out}: safetensors files not in the index: {', '.join(stray)}")
    return layout


def check_config(source: Source, out: Path, report: VerifyReport) -> tuple[bool, QuantizationConfig | None]:
    """The output's config.json: the source's plus a quantization_config this module can read, or, for
    an FP8 source's dequantized output, the source's without one. (readable, layout): layout None for a
    dequantized output."""
    config_path = out / "config.json"
    try:
        config = json.loads(config_path.read_text())
        if not isinstance(config, dict):
            raise FP8ConvertError(f"{config_path}: not a JSON object")
        dequantized = source.quant is not None and "quantization_config" not in config  # written by `dequantize`
        fmt = None if dequantized else read_quantization_config(config, str(config_path))
    except FileNotFoundError:
        report.fail(str(config_path), "missing: the output is incomplete")
        return False, None
    except ValueError as e:
        report.fail(str(config_path), f"not valid JSON ({e})")
        return False, None
    except FP8ConvertError as e:
        report.fail(str(config_path), str(e).removeprefix(f"{config_path}: "))
        return False, None
    for promise in fmt.unkept if fmt else ():  # what loaders act on though no tensor backs it
        report.fail(str(config_path), promise)
    rest = {k: v for k, v in config.items() if k != "quantization_config"}
    source_rest = {k: v for k, v in source.config.items() if k not in ("quantization_config", "compression_config")}
    if rest != source_rest:
        keys = sorted(k for k in set(rest) | set(source_rest) if rest.get(k) != source_rest.get(k))
        report.fail(
            str(config_path),
            f"differs from the source's config.json beyond quantization_config (keys: {', '.join(keys)})",
        )
    return True, fmt


def check_manifest_and_side_files(source: Source, out: Path, report: VerifyReport) -> None:
    manifest = Manifest(out)
    try:
        state = manifest.read()
        if state is not None and not state.get("complete"):
            report.fail(str(manifest.path), "the conversion did not finish; rerun it")
    except FP8ConvertError:
        report.fail(str(manifest.path), "unreadable")
    for name in source.copy_files:
        copied = out / name
        if not copied.is_file() or copied.read_bytes() != (source.root / name).read_bytes():
            report.warnings.append(f"{copied}: missing or different from the source's {name}")
