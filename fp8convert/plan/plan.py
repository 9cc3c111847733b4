"""The plan: a pure, deterministic function of (headers, config.json, options).

It fixes every output tensor's name, dtype, shape, shard and byte offset before any data is read, so
the writer streams into shards whose headers are already known, workers can split the work, and a
rerun can tell whether an existing partial output came from the same plan (its fingerprint).
"""
from __future__ import annotations

import enum
import hashlib
import json
import math
import re
from dataclasses import dataclass, field

from .._version import __version__
from ..errors import FP8ConvertError
from ..formats import CONFIGS, get_format
from ..formats.sources import SourceQuantization
from ..options import Options
from ..safetensors_io import DTYPE_SIZES, FP8, OutputTensor, TensorInfo, layout_shard
from ..source.checkpoint import Source
from ..units import plural
from .architectures import GENERIC, Architecture, architecture_of, mtp_layers
from .cuts import Cut
from .rules import Decision, decide, experts_of, is_linear_weight, module_of

LAYER_PATTERN = re.compile(r"^(.*?\.(?:layers|layer|h|blocks|block)\.\d+)\.")


class Action(enum.Enum):
    """What is done to the source to make an output tensor. New kinds of source (an FP8 weight with
    its scale, MXFP8 with uint8 scales) add actions here and inputs to TensorPlan, not a new plan."""

    KEEP = "keep"                # the source bytes (or a cut of them) unchanged
    QUANTIZE = "quantize"        # FP8 codes and their scales (float32, or MXFP8's E8M0 bytes) from a high-precision
                                 # weight
    DEQUANTIZE = "dequantize"    # a high-precision weight from FP8 codes and scale: float32(q) * scale, cast once
    REQUANTIZE = "requantize"    # FP8 codes and scales in the output's scheme, as QUANTIZE makes them, from an FP8
                                 # weight's dequantized (float32) values
    PASS = "pass"                # an FP8 weight's codes and scale as they are: the output's scheme is the source's


FP8_OUT = (Action.QUANTIZE, Action.REQUANTIZE, Action.PASS)
COMPUTED = (Action.QUANTIZE, Action.REQUANTIZE, Action.DEQUANTIZE)


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor (and its scale, when quantized) and how it is made from the source."""

    name: str                             # the output tensor's name
    inputs: tuple[TensorInfo, ...]        # source tensors it is made from: the weight, then (FP8 sources) its
                                          # scale, then the static activation scale carried to the output
    action: Action
    reason: str | None                    # why it stays in high precision (None when quantized)
    group: str | None                     # fused group: members share one scale in the tensor scheme
    scale_name: str | None = None
    scale_shape: tuple[int, ...] | None = None
    cut: Cut | None = None                # the part of the source it is (fused experts); None: all of it
    at: int = 0                           # for a piece of a kept tensor (kept_pieces): where it starts in it
    out_dtype: str | None = None          # DEQUANTIZE: the high-precision dtype written
    input_scale_name: str | None = None   # a static activation scale (the last input) copied to this name
    scale_dtype: str = "F32"              # U8 for MXFP8's E8M0 bytes; PASS: the source scale's own dtype

    @property
    def source(self) -> TensorInfo:
        return self.inputs[0]

    @property
    def source_scale(self) -> TensorInfo | None:
        """An FP8 source weight's scale."""
        return self.inputs[1] if self.source.dtype == FP8 else None

    @property
    def quantize(self) -> bool:
        """The output is FP8: quantized here, requantized, or passed through from an FP8 source."""
        return self.action in FP8_OUT

    @property
    def computed(self) -> bool:
        """The output is computed on the device (not a plain copy of source bytes)."""
        return self.action in COMPUTED or self.cut is not None

    @property
    def copies(self) -> list[tuple[TensorInfo, str]]:
        """(source tensor, output name) of a plain byte copy: a kept tensor, or a passed-through weight's
        codes, scale and static activation scale."""
        if self.action is Action.KEEP and self.cut is None:
            return [(self.source, self.name)]
        if self.action is Action.PASS:
            return list(zip(self.inputs, [self.name, self.scale_name, self.input_scale_name]))
        if self.input_scale_name:  # a requantized weight's static activation scale
            return [(self.inputs[-1], self.input_scale_name)]
        return []

    @property
    def shape(self) -> tuple[int, ...]:
        return self.cut.shape(self.source.shape) if self.cut else self.source.shape

    @property
    def in_bytes(self) -> int:
        """Bytes of the source this output is made from (all of them unless it is a cut)."""
        if not self.cut:
            return sum(info.nbytes for info in self.inputs)
        return math.prod(self.shape) * DTYPE_SIZES[self.source.dtype]

    @property
    def dtype(self) -> str:
        """The dtype of the main output."""
        if self.action is Action.KEEP:
            return self.source.dtype
        return self.out_dtype if self.action is Action.DEQUANTIZE else FP8

    def outputs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every output tensor this plan produces."""
        if not self.quantize:
            return [(self.name, self.dtype, self.shape)]
        outputs = [(self.name, FP8, self.shape), (self.scale_name, self.scale_dtype, self.scale_shape)]
        if self.input_scale_name:  # per tensor, shaped as the format shapes a per-tensor scale ([] or [1])
            outputs.append((self.input_scale_name, self.inputs[-1].dtype, self.scale_shape))
        return outputs

    @property
    def out_bytes(self) -> int:
        return sum(math.prod(shape) * DTYPE_SIZES[dtype] for _, dtype, shape in self.outputs())


def unique_inputs(tensors: list[TensorPlan]) -> list[TensorInfo]:
    """The source tensors `tensors` read, each once, in order (outputs cut from one source share it)."""
    return list({info.name: info for t in tensors for info in t.inputs}.values())


@dataclass
class Unit:
    """At most one decoder layer: the granularity of shard breaks and of the work split."""

    label: str
    tensors: list[TensorPlan]

    @property
    def in_bytes(self) -> int:
        return sum(info.nbytes for info in unique_inputs(self.tensors))

    @property
    def out_bytes(self) -> int:
        return sum(t.out_bytes for t in self.tensors)

    def atoms(self) -> list[list[TensorPlan]]:
        """Pieces that must never be split: every output cut from one source tensor (so it is read
        once), a quantized fused group (one scale), or a single tensor."""
        atoms: dict[str, list[TensorPlan]] = {}
        for t in self.tensors:
            shares_scale = t.action in (Action.QUANTIZE, Action.REQUANTIZE)
            key = (f"cut:{t.source.name}" if t.cut else f"group:{t.group}" if t.group and shares_scale
                   else f"tensor:{t.name}")
            atoms.setdefault(key, []).append(t)
        return list(atoms.values())


@dataclass
class Shard:
    index: int
    name: str
    units: list[int]                      # indices of units with tensors in this shard
    header: bytes                         # complete header, length prefix included
    tensors: dict[str, OutputTensor]      # placement within the data buffer

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors.values())


@dataclass
class Plan:
    source: Source
    options: Options
    units: list[Unit]
    shards: list[Shard]
    shard_of: dict[str, int]              # output tensor name -> shard index
    ignore_list: list[str]                # linear modules left unquantized, as engines match them
    notes: list[str] = field(default_factory=list)
    fingerprint: str = ""
    architecture: Architecture | None = None   # the registry's family; None: generic rules only
    # what the user asked for that did not happen as asked (summary.plan_warnings adds where it will not load)
    warnings: list[str] = field(default_factory=list)

    @property
    def tensors(self) -> list[TensorPlan]:
        return [t for u in self.units for t in u.tensors]

    @property
    def out_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def source_scheme(self) -> str:
        """An FP8 source's scheme (how its scales are laid out); "" for a high-precision source."""
        return self.source.quant.scheme if self.source.quant else ""

    @property
    def static_activations(self) -> bool:
        """Static activation scales are carried (FP8 source with them, tensor scheme out)."""
        return any(t.input_scale_name for t in self.tensors)

    def quantization_config(self) -> dict | None:
        """The output's quantization_config; None for a dequantized output (it has none)."""
        if self.options.dequantize:
            return None
        return CONFIGS[self.options.format](self.options.scheme, tuple(self.ignore_list), self.options.scale_format,
                                            self.static_activations).to_dict()


def natural_key(text: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def group_into_units(tensors: list[TensorPlan]) -> list[Unit]:
    """One unit per decoder layer; each tensor outside the layers (embeddings, final norm, head) is a
    unit of its own, so no unit is larger than a layer or a single tensor. Natural name order."""
    by_label: dict[str, list[TensorPlan]] = {}
    for t in tensors:
        m = LAYER_PATTERN.match(t.name)
        by_label.setdefault(m.group(1) if m else t.name, []).append(t)
    return [Unit(lbl, sorted(by_label[lbl], key=lambda t: natural_key(t.name)))
            for lbl in sorted(by_label, key=natural_key)]


def assign_shards(units: list[Unit], max_shard_size: int) -> list[list[tuple[int, list[TensorPlan]]]]:
    """Fill shards in unit order, breaking between units; a unit larger than a shard breaks between atoms."""
    shards: list[list[tuple[int, list[TensorPlan]]]] = [[]]
    used = 0
    for ui, unit in enumerate(units):
        pieces = [unit.tensors] if unit.out_bytes <= max_shard_size else unit.atoms()
        for piece in pieces:
            size = sum(t.out_bytes for t in piece)
            if used and used + size > max_shard_size:
                shards.append([])
                used = 0
            shards[-1].append((ui, piece))
            used += size
    return [s for s in shards if s]


def fingerprint(source: Source, options: Options) -> str:
    """Identifies the output: same fingerprint, same bytes. Covers tool version, options and layout."""
    listed = [options.scheme, options.format, list(options.ignore), options.max_shard_size, list(options.target_tp)]
    # Each addition only when set, so the defaults keep earlier fingerprints.
    if options.scale_format != "float":
        listed.append(options.scale_format)
    if options.dequantize or options.dtype:
        listed += [options.dequantize, options.dtype]
    blob = json.dumps({
        "tool": __version__,
        "options": listed,
        "tensors": [[t.name, t.dtype, list(t.shape), t.file, t.offset] for t in source.tensors],
        "config": source.config,
    }, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# config.json's dtype names -> the safetensors dtype of a dequantized weight
MODEL_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def high_precision_dtype(options: Options, config: dict) -> str:
    """What a dequantized weight is written as: --dtype, else the model's dtype (config.json), else BF16."""
    return options.dtype or MODEL_DTYPES.get(str(config.get("torch_dtype", config.get("dtype"))), "BF16")


def tensor_plan(d: Decision, quant: SourceQuantization | None, options: Options, high_precision: str) -> TensorPlan:
    """How decision `d` is made. An FP8 source weight kept in high precision is dequantized; one that
    stays FP8 passes through when its scales are already the output's (passes_through), and is
    requantized from its dequantized values otherwise. Its static activation scale goes with it when
    the output's activations are per tensor."""
    fmt = get_format(options.format)
    fp8_weight = quant.weights.get(d.source.name) if quant else None
    if fp8_weight is None:
        if not d.quantize:
            return TensorPlan(d.name, (d.source,), Action.KEEP, d.reason, d.group, cut=d.cut)
        shape = d.cut.shape(d.source.shape) if d.cut else d.source.shape
        return TensorPlan(d.name, (d.source,), Action.QUANTIZE, None, d.group, fmt.scale_name(d.name, options.scheme),
                          fmt.scale_shape(shape, options.scheme), d.cut, scale_dtype=fmt.scale_dtype(options.scheme))
    inputs = (fp8_weight.weight, fp8_weight.scale)
    if not d.quantize:
        return TensorPlan(d.name, inputs, Action.DEQUANTIZE, d.reason, d.group, out_dtype=high_precision)
    carried = None
    if fp8_weight.input_scale is not None and options.scheme == "tensor":
        inputs += (fp8_weight.input_scale,)
        carried = module_of(d.name) + ".input_scale"
    if passes_through(quant, options):  # the scale keeps its dtype
        action, scale_dtype = Action.PASS, fp8_weight.scale.dtype
    else:
        action, scale_dtype = Action.REQUANTIZE, fmt.scale_dtype(options.scheme)
    return TensorPlan(d.name, inputs, action, None, d.group, fmt.scale_name(d.name, options.scheme),
                      fmt.scale_shape(d.source.shape, options.scheme), input_scale_name=carried,
                      scale_dtype=scale_dtype)


def passes_through(quant: SourceQuantization, options: Options) -> bool:
    """Whether an FP8 source's codes and scales are already what the output asks for: same scheme (the
    format only names the scale), and, for --scale-format ue8m0, block scales the source declares
    powers of two (the pipeline checks each value). Re-deriving scales would change codes wherever the
    source's are not amax / 448, so a source that fits passes as it is; power-of-two scales are
    float scales too, so a ue8m0 source passes into a float output."""
    return quant.scheme == options.scheme and (options.scale_format == "float" or quant.config.scale_fmt == "ue8m0")


def source_notes(quant: SourceQuantization | None, plans: list[TensorPlan], options: Options) -> list[str]:
    """What becomes of an FP8 source's extras that the output cannot say the same way."""
    if quant is None:
        return []
    notes = []
    dropped = [t.name for t in plans if t.quantize and quant.weights.get(t.source.name)
               and quant.weights[t.source.name].input_scale is not None and not t.input_scale_name]
    if dropped:
        notes.append(f"the source's static activation scales (input_scale) of {len(dropped)} FP8 weights are not "
                     f"carried: the {options.scheme} scheme's activations are dynamic (only the tensor scheme "
                     "takes static per-tensor activation scales)")
    if quant.config.scale_fmt == "ue8m0" and not options.dequantize and options.scale_format != "ue8m0":
        notes.append("the source's scale_fmt 'ue8m0' is not written to the output: its stored scales are used as "
                     "they are (transformers would round scales that are not powers of two under it; "
                     "--scheme block --scale-format ue8m0 keeps it)")
    return notes


def check_layers(source: Source) -> None:
    """Refuse a checkpoint whose weights lack decoder layers: a numbering gap in a stack of layers, or
    fewer layers in every stack than config.json's num_hidden_layers (its text_config's for a
    multimodal model). A shard left out of a download does this, and the output would load with those
    layers missing or randomly initialised. More layers than the config says are fine (DeepSeek's MTP
    layer follows the decoder's)."""
    stacks: dict[str, set[int]] = {}
    for t in source.tensors:
        if m := LAYER_PATTERN.match(t.name):
            prefix, _, index = m.group(1).rpartition(".")
            stacks.setdefault(prefix, set()).add(int(index))
    for prefix, indices in sorted(stacks.items()):
        missing = sorted(set(range(max(indices) + 1)) - indices)
        if missing:
            raise FP8ConvertError(f"{source.label}: the weights hold {prefix} {describe_numbers(sorted(indices))} but "
                                  f"not {describe_numbers(missing)}; a shard or its tensors are missing")
    declared, text = source.config.get("num_hidden_layers"), source.config.get("text_config")
    if declared is None and isinstance(text, dict):
        declared = text.get("num_hidden_layers")
    if isinstance(declared, int) and not isinstance(declared, bool) and stacks and \
            max(len(i) for i in stacks.values()) < declared:
        prefix, indices = max(stacks.items(), key=lambda item: len(item[1]))
        raise FP8ConvertError(f"{source.label}: config.json says num_hidden_layers {declared}, but the weights hold "
                              f"{plural(len(indices), 'layer')} of {prefix}; a shard or its tensors are missing")


def describe_numbers(numbers: list[int]) -> str:
    """'1', '0-4', '0-4 and 7', '1, 3 and 5' (sorted, distinct)."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def build_plan(source: Source, options: Options) -> Plan:
    check_layers(source)
    quant = source.quant
    if options.dequantize and quant is None:
        raise FP8ConvertError(f"{source.label}: holds no FP8 weights (config.json has no FP8 quantization_config); "
                              "nothing to dequantize")
    arch = architecture_of(source.config)
    decisions, notes, warnings = decide(source.tensors, source.config, options, arch or GENERIC, quant)
    high_precision = high_precision_dtype(options, source.config)
    plans = [tensor_plan(d, quant, options, high_precision) for d in decisions]
    notes += source_notes(quant, plans, options)
    if not any(t.quantize for t in plans) and not options.dequantize:
        notes.append("no tensor is quantized: every weight is kept in high precision")
    units = group_into_units(plans)

    shards, shard_of = [], {}
    layout = assign_shards(units, options.max_shard_size)
    count = len(layout)
    for index, pieces in enumerate(layout):
        name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        entries = [out for _, atom in pieces for t in atom for out in t.outputs()]
        header, placed = layout_shard(entries)
        shards.append(Shard(index, name, sorted({ui for ui, _ in pieces}), header, placed))
        shard_of.update({n: index for n in placed})

    notes += architecture_notes(arch, source)
    if options.dequantize:  # no FP8 left: nothing for engines to skip
        return Plan(source, options, units, shards, shard_of, [], notes, fingerprint(source, options), arch, warnings)
    if source.config.get("torch_dtype", source.config.get("dtype")) == "float32":
        notes.append("the model's dtype is float32: serving engines run FP8 kernels with bfloat16/float16 "
                     "activations; consider serving with --dtype bfloat16")
    ignore = ignore_list(plans, arch or GENERIC, source.config, options.format)
    return Plan(source, options, units, shards, shard_of, ignore, notes, fingerprint(source, options), arch,
                warnings)


def ignore_list(plans: list[TensorPlan], arch: Architecture, config: dict, fmt: str) -> list[str]:
    """Every linear module left unquantized, by its full name as the checkpoint, transformers (in
    memory) and vLLM (after its mapper) each name it: vLLM and transformers match exact names (and
    `re:` regexes in compressed-tensors), and each renames differently. A MoE layer whose experts are
    all kept is also named as a whole, the way each consumer's experts module is matched: vLLM's fp8
    path by a substring of the experts prefix, compressed-tensors by per-expert names (only a regex
    covers every naming, and one expert's module is not always a real module)."""
    entries: set[str] = set()
    for t in plans:
        if not t.quantize and is_linear_weight(t.name, t.shape, t.dtype, t.reason):
            module = module_of(t.name)
            if experts_of(t.name):  # transformers holds these experts fused (no per-expert module to name),
                # or, where it splits them (Llama-4), under the checkpoint's own names
                entries.update((module, arch.vllm_name(module, config)))
            else:
                entries.update(arch.names(module, config))
    for experts in kept_expert_blocks(plans, arch):
        names = arch.names(experts, config)
        if fmt == "compressed-tensors":
            entries.add("re:^(" + "|".join(re.escape(n) for n in names) + r")(\.|$)")
        else:
            entries.update(names)
    ignore = sorted(entries, key=natural_key)
    if "lm_head" not in ignore:  # tied heads have no tensor; transformers only skips what the list names
        ignore.insert(0, "lm_head")
    return ignore


def kept_expert_blocks(plans: list[TensorPlan], arch: Architecture) -> list[str]:
    """Experts modules (e.g. `model.layers.1.mlp.experts`) none of whose outputs is quantized."""
    quantized: dict[str, bool] = {}
    for t in plans:
        fused = arch.expert_tensor(t.name)
        experts = fused[1] if fused else experts_of(t.name)
        if experts:
            quantized[experts] = quantized.get(experts, False) or t.quantize
    return sorted((e for e, q in quantized.items() if not q), key=natural_key)


def architecture_notes(arch: Architecture | None, source: Source) -> list[str]:
    """What the registry knows (or not) about this model, for the user."""
    config = source.config
    if arch is None:
        return [f"model_type {config.get('model_type')!r} is not in fp8convert's architecture registry: the "
                "generic rules apply (see the README's supported architectures); check the ignore list against "
                "your engine and run fp8convert verify"]
    names = {t.name for t in source.tensors}
    missing = [layer for layer in mtp_layers(arch, config) if not any(n.startswith(layer + ".") for n in names)]
    if missing:
        return [f"config.json declares MTP layer(s) {', '.join(missing)} (num_nextn_predict_layers), but the "
                "checkpoint has none: the output cannot serve MTP speculative decoding either"]
    return []
