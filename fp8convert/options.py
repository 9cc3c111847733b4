"""What the user asked for, validated once, before anything is read: `Options` decide the output bytes,
`Settings` add where and how to run, `HubAccess` is how a Hub source is reached. All are frozen dataclasses,
so a run can be handed to another process whole (`--devices`)."""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import enum
import functools
import os
import re
from dataclasses import dataclass, fields, replace

from .errors import FP8ConvertError, UsageError


class Scheme(enum.StrEnum):
    """--scheme values. Options holds the plain string; a member compares equal to it."""

    TENSOR = "tensor"  # one scale per weight
    CHANNEL = "channel"  # one scale per output row
    BLOCK = "block"  # one scale per 128x128 block
    MXFP8 = "mxfp8"  # one power-of-two scale per 32 inputs of a row
    NVFP4A16 = "nvfp4a16"  # 4-bit float weights: an FP8 scale per 16 inputs of a row, a float32 one per weight
    MXFP4A16 = "mxfp4a16"  # 4-bit float weights: a power-of-two scale per 32 inputs of a row


class Format(enum.StrEnum):
    """--format values: how the checkpoint names its scales and describes its quantization."""

    COMPRESSED_TENSORS = "compressed-tensors"
    FP8 = "fp8"


class ScaleFormat(enum.StrEnum):
    """--scale-format values: block scales as amax / 448, or rounded up to a power of two."""

    FLOAT = "float"
    UE8M0 = "ue8m0"


SCHEMES = tuple(s.value for s in Scheme)
# llm-compressor's preset names, accepted for --scheme in any case: its FP8 preset has per-tensor weights
# (and static activation scales, which fp8convert does not write), FP8_DYNAMIC per-channel, FP8_BLOCK blocks
SCHEME_ALIASES = {"fp8": "tensor", "fp8_dynamic": "channel", "fp8_block": "block"}
FORMATS = tuple(f.value for f in Format)
SCALE_FORMATS = tuple(f.value for f in ScaleFormat)
BLOCK = 128  # block scheme: 128x128 weight blocks, one scale each
MX_GROUP = 32  # mxfp8: one power-of-two scale per 32 consecutive input elements of a row (OCP MX)
FP4_SCHEMES = (Scheme.NVFP4A16, Scheme.MXFP4A16)  # weights as 4-bit floats (E2M1), activations in 16 bits
GROUP_SIZE = {Scheme.MXFP8: MX_GROUP, Scheme.NVFP4A16: 16, Scheme.MXFP4A16: MX_GROUP}  # inputs of a row per scale
TARGET_TP = (1, 2, 4, 8)  # tensor-parallel sizes checked against vLLM's splitting rules by default
# --dtype of dequantized weights: its spellings -> the safetensors dtype written
DTYPE_NAMES = dict.fromkeys(("bf16", "bfloat16"), "BF16") | dict.fromkeys(("fp16", "float16", "half"), "F16")
DTYPE_NAMES |= dict.fromkeys(("fp32", "float32", "float"), "F32")
CONFIG_DTYPE_KEYS = ("torch_dtype", "dtype")  # config.json's dtype (torch's name): transformers 4's key, and 5's
DEVICE_TEXT = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a Hub repo id, owner/name


def env_number(env, name: str, default=None, kind=int):
    """The environment variable `name` of `env` as `kind` (int or float); `default` where it is unset or empty."""
    text = env.get(name, "")
    if not text:
        return default
    try:
        return kind(text)
    except ValueError:
        raise FP8ConvertError(f"${name}={text!r}: not {'an integer' if kind is int else 'a number'}") from None


def parse_size(value: int | str, what: str = "size") -> int:
    """'5GB' -> 5_000_000_000 (decimal, as transformers' max_shard_size); '2GiB' is binary; ints pass."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(I?)B?\s*", str(value).upper())
        if not m or (m.group(3) and not m.group(2)):
            raise UsageError(f"{what}: cannot read {value!r} as a size (examples: 500MB, 5GB, 2GiB)")
        power = " KMGT".index(m.group(2) or " ")
        size = int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)
    if size <= 0:
        raise UsageError(f"{what} must be positive, got {value!r}")
    return size


@dataclass(frozen=True)
class HubAccess:
    """How a Hub source is reached; None takes huggingface_hub's default (main, HF_TOKEN or login, its cache)."""

    revision: str | None = None
    token: str | None = None
    cache_dir: str | None = None


@dataclass(frozen=True)
class Options:
    """The choices that fix the output: with the same source they give the same bytes. The manifest
    records them under their field names (`record`, `from_record`)."""

    scheme: str = "tensor"
    format: str = "compressed-tensors"
    ignore: tuple[str, ...] = ()
    max_shard_size: int | str = 5 * 10**9  # text ('5GB') is parsed
    target_tp: tuple[int, ...] = TARGET_TP  # the model card reports vLLM's limits at these sizes
    scale_format: str = "float"  # block scales: "ue8m0" rounds each up to a power of two
    dequantize: bool = False  # FP8 source to high precision (scheme and format do not apply)
    dtype: str | None = None  # dequantized weights' dtype (bf16, fp16, fp32); None: the model's own
    # a mixed recipe: (module pattern, scheme) rules over `scheme`, which takes the modules no rule matches
    recipe: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        _set(
            self,
            scheme=parse_scheme(self.scheme),
            recipe=parse_recipe(self.recipe),
            format=one_of(self.format, "--format", FORMATS),
            scale_format=one_of(self.scale_format, "--scale-format", SCALE_FORMATS),
        )
        if self.dequantize and self.scale_format != ScaleFormat.FLOAT:
            raise UsageError("--scale-format does not apply to dequantize: it writes no FP8 scales")
        if self.dequantize and (self.scheme, self.format) != (Scheme.TENSOR, Format.COMPRESSED_TENSORS):
            raise UsageError("--scheme and --format do not apply to dequantize: it writes no FP8 weights")
        if self.format == Format.FP8 and self.scheme not in (Scheme.TENSOR, Scheme.BLOCK):
            what = {Scheme.CHANNEL: "per-channel", Scheme.MXFP8: "MXFP8"}.get(self.scheme, "FP4")
            raise UsageError(
                f"--format fp8 has no {what} scheme (vLLM reads it from compressed-tensors checkpoints); use "
                f"--scheme tensor or block, or --format compressed-tensors --scheme {self.scheme}"
            )
        if self.recipe and self.format == Format.FP8:
            raise UsageError(
                "a recipe of several schemes needs --format compressed-tensors (one config group per scheme)"
            )
        if self.recipe and self.dequantize:
            raise UsageError("a recipe does not apply to dequantize: it writes no FP8 or FP4 weights")
        if self.scale_format == ScaleFormat.UE8M0 and (
            other := next((s for s in self.schemes if s != Scheme.BLOCK), None)
        ):
            raise UsageError(
                f"--scale-format ue8m0 applies to --scheme block only, got --scheme {other}"
                + (f" ({other[:5].upper()} scales are powers of two already)" if other[:2] == "mx" else "")
            )
        _set(  # after the scheme and format checks, whose errors come first
            self,
            ignore=(self.ignore,) if isinstance(self.ignore, str) else tuple(self.ignore or ()),  # one pattern alone
            max_shard_size=parse_size(self.max_shard_size, "--max-shard-size"),
            target_tp=parse_target_tp(self.target_tp),
            dtype=parse_dtype(self.dtype),
        )
        if self.dtype and not self.dequantize:
            raise UsageError(
                f"--dtype applies to dequantize only (quantize writes FP8 weights and keeps the "
                f"rest in the model's dtype), got {self.dtype}"
            )
        if self.dequantize and self.ignore:
            raise UsageError("--ignore does not apply to dequantize: every FP8 weight is dequantized")
        for pattern in self.ignore:
            if problem := regex_error(pattern):
                raise UsageError(f"--ignore {pattern!r}: bad regular expression ({problem})")

    @property
    def schemes(self) -> tuple[str, ...]:
        """Every scheme the output may hold: the default, then the recipe's in order."""
        return tuple(dict.fromkeys([self.scheme, *(scheme for _, scheme in self.recipe)]))

    def record(self) -> dict:
        """The options as the manifest stores them: by field name, tuples as JSON lists."""
        values = {f.name: getattr(self, f.name) for f in fields(Options) if f.name != "recipe"}
        if self.recipe:  # only when set: a manifest without the key means none, as older outputs' do
            values["recipe"] = [list(rule) for rule in self.recipe]
        return {name: list(v) if isinstance(v, tuple) else v for name, v in values.items()}

    @classmethod
    def from_record(cls, state: dict) -> Options:
        """The options a manifest records; a key it lacks, or holds null or empty, takes the default."""
        return cls(**{f.name: state[f.name] for f in fields(Options) if state.get(f.name) not in (None, "", [])})


def _set(frozen, **values) -> None:
    """Store the parsed values on a frozen dataclass while it validates itself."""
    for name, value in values.items():
        object.__setattr__(frozen, name, value)


def did_you_mean(text: str, names) -> str:
    """'; did you mean 'channel'?' for 'chanel' among `names`, or '' when none is close."""
    close = difflib.get_close_matches(str(text).strip().lower(), list(names), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def one_of(value: str, option: str, choices: tuple[str, ...], aliases: dict[str, str] | None = None) -> str:
    """`value` as one of `choices` (or `aliases`' keys), in any case; else a usage error offering a close match."""
    names = {c: c for c in choices} | (aliases or {})
    text = str(value).strip().lower()
    if text not in names:
        raise UsageError(f"{option} {value!r}: expected one of {', '.join(choices)}{did_you_mean(text, names)}")
    return names[text]


def parse_scheme(value: str, option: str = "--scheme") -> str:
    """A --scheme as fp8convert names it: 'channel' for 'channel', 'Channel' or 'FP8_DYNAMIC'."""
    return one_of(value, option, SCHEMES, SCHEME_ALIASES)


def parse_recipe(rules, where: str = "") -> tuple[tuple[str, str], ...]:
    """A recipe's rules as (pattern, scheme) pairs, from a mapping, pairs or 'PATTERN=SCHEME' texts; a pattern
    is what --ignore takes; a pattern given twice must give one scheme. Errors name `where` (the recipe file),
    else --scheme."""
    parsed: dict[str, str] = {}
    for rule in rules.items() if isinstance(rules, dict) else rules if isinstance(rules, (list, tuple)) else (rules,):
        if isinstance(rule, str):  # the scheme follows the last '=': 're:.*experts.*=nvfp4a16'
            pattern, equals, scheme = rule.rpartition("=")
            if not equals:
                raise UsageError(f"--scheme {rule!r}: a recipe rule is PATTERN=SCHEME")
        elif isinstance(rule, (list, tuple)) and len(rule) == 2:
            pattern, scheme = rule
        else:
            raise UsageError(f"{where or '--scheme'}: recipe rule {rule!r} is not PATTERN=SCHEME")
        said = f"{where}: rule {pattern!r} = {scheme!r}" if where else f"--scheme {pattern}={scheme}"
        if not str(pattern).strip():
            raise UsageError(f"{said}: a rule needs a module pattern before '='")
        if problem := regex_error(pattern):
            raise UsageError(f"{said}: bad regular expression ({problem})")
        try:
            scheme = parse_scheme(scheme)
        except UsageError as e:
            raise UsageError(f"{said}: {str(e).split(': ', 1)[1]}") from None
        if parsed.setdefault(str(pattern), scheme) != scheme:
            raise UsageError(f"{said}: another rule gives {pattern} {parsed[str(pattern)]}; give a pattern one scheme")
    return tuple(parsed.items())


def regex_error(pattern: str) -> str | None:
    """Why an `re:` ignore pattern (--ignore's, or a source's quantization_config's) does not compile, else None."""
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as e:
            return str(e)
    return None


def parse_dtype(value: str | None) -> str | None:
    """'bf16', 'fp16', 'fp32' (or their torch names, or the safetensors ones) -> 'BF16', 'F16', 'F32'."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text.upper() in DTYPE_NAMES.values():
        return text.upper()
    if text not in DTYPE_NAMES:
        raise UsageError(f"--dtype {value!r}: expected bf16, fp16 or fp32{did_you_mean(text, DTYPE_NAMES)}")
    return DTYPE_NAMES[text]


def parse_target_tp(sizes) -> tuple[int, ...]:
    """Sorted distinct tensor-parallel sizes, each a positive integer (text is accepted: the CLI), or one alone."""
    if not isinstance(sizes, (list, tuple, set)):
        sizes = [sizes]
    # whole numbers or their text (the CLI's); not true (an int to Python) or 2.5
    if not all(type(v) is int or (isinstance(v, str) and v.strip().lstrip("-").isdigit()) for v in sizes):
        raise UsageError(f"--target-tp: expected whole numbers, got {list(sizes)!r}")
    values = sorted({int(v) for v in sizes})
    if not values or values[0] < 1:
        raise UsageError(f"--target-tp: sizes must be 1 or more, got {list(sizes)!r}")
    return tuple(values)


# Errors name options as the command line spells them (--max-shard-size, --overwrite). Raised through the
# Python API they name its keywords instead (max_shard_size, overwrite=True); the CLI keeps its flags.
_COMMAND_LINE = contextvars.ContextVar("fp8convert_command_line", default=False)
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")


@contextlib.contextmanager
def command_line():
    """While the CLI runs a command: errors keep naming its flags."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def keyword_spelling(message: str) -> str:
    """`message` with each flag that is a Settings field as its keyword: `--max-shard-size` ->
    `max_shard_size`, a flag that takes no value (`--overwrite`) -> `overwrite=True`."""
    known = {f.name: f.default for f in fields(Settings)}

    def keyword(match: re.Match) -> str:
        name = match.group(1).replace("-", "_")
        if name not in known:
            return match.group(0)
        return f"{name}=True" if known[name] is False else name

    return FLAG.sub(keyword, message)


def python_spelling(function):
    """For the API's entry points: an FP8ConvertError leaving `function`, and the warnings of what it returns,
    name keywords, unless the CLI called it."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            result = function(*args, **kwargs)
        except FP8ConvertError as e:
            if not _COMMAND_LINE.get():
                e.args = (keyword_spelling(str(e)),)
            raise
        if not _COMMAND_LINE.get() and isinstance(getattr(result, "warnings", None), list):
            result.warnings = [keyword_spelling(w) for w in result.warnings]
        return result

    return call


DEFAULT_MAX_RESIDENT = {"cuda": 256 * 2**20, "cpu": 1 * 2**30}  # bytes of one batch's inputs, by device
AUTO = "auto"


@dataclass(frozen=True)
class Settings(Options):
    """Everything a conversion needs besides SRC and OUT: the Options, and where and how to run. Sizes given
    as text ('5GB') are parsed here, so a bad value fails before anything is read or written."""

    device: str = "auto"  # auto, cpu, cuda, cuda:N
    devices: str | tuple[str, ...] | None = None  # one worker process per device: "cuda:0,cuda:1" or "all"
    worker: object = None  # this process's share: "K/N", (K, N), "auto", a WorkerSpec; None detects
    max_resident: int | str | None = None  # device memory budget of one batch; None: the device type's default
    prefetch: int | str = AUTO  # page-cache read-ahead window; 0 turns it off; auto: prefetch.default_window
    prefetch_threads: int | None = None
    overwrite: bool = False
    revision: str | None = None  # Hub sources: branch, tag or commit
    token: str | None = None  # Hub token; None: HF_TOKEN or the saved login
    cache_dir: str | None = None  # Hub download cache; None: huggingface_hub's (HF_HUB_CACHE, HF_HOME)
    base_model: str | None = None  # the model card's base_model; None: a Hub source's repo id
    stream_download: bool = False  # Hub sources: keep only a few source shards on disk
    # write an output vLLM cannot load at any TP size (refused by default); None: $FP8CONVERT_WRITE_UNLOADABLE
    write_unloadable: bool | None = None
    progress: bool = False
    finalize: bool = True  # False: write this worker's shards only

    @python_spelling
    def __post_init__(self):
        super().__post_init__()
        for f in fields(self):  # a switch takes True or False: "no" would be true
            if isinstance(f.default, bool) and not isinstance(getattr(self, f.name), bool):
                raise UsageError(f"{f.name}={getattr(self, f.name)!r}: expected True or False")
        threads = self.prefetch_threads
        if threads is not None and (type(threads) is not int or threads < 1):
            raise UsageError(f"prefetch_threads={threads!r}: expected a whole number of threads, 1 or more")
        if not DEVICE_TEXT.match(str(self.device)):  # spelling only: whether CUDA is there needs torch
            raise UsageError(
                f"--device {self.device!r}: expected auto, cpu, cuda or cuda:N"
                + did_you_mean(self.device, ("auto", "cpu", "cuda"))
            )
        if self.max_resident:
            _set(self, max_resident=parse_size(self.max_resident, "--max-resident"))
        prefetch = str(self.prefetch).strip().lower()
        window = AUTO if prefetch == AUTO else 0 if prefetch in ("0", "") else parse_size(self.prefetch, "--prefetch")
        _set(self, prefetch=window)
        if isinstance(self.devices, list):
            _set(self, devices=tuple(self.devices))
        if self.base_model is not None and not REPO_ID.match(self.base_model):
            raise UsageError(f"--base-model {self.base_model}: not a Hub repo id (owner/name)")
        if self.write_unloadable is None:
            _set(self, write_unloadable=os.environ.get("FP8CONVERT_WRITE_UNLOADABLE", "").strip() not in ("", "0"))

    @property
    def options(self) -> Options:
        return Options(**{f.name: getattr(self, f.name) for f in fields(Options)})

    @property
    def hub(self) -> HubAccess:
        return HubAccess(self.revision, self.token, self.cache_dir)

    @classmethod
    def of(cls, settings: Settings | None = None, **overrides) -> Settings:
        """`settings` with `overrides` (keyword names are the fields); an unknown name is an error."""
        if unknown := sorted(set(overrides) - SETTING_NAMES):
            raise TypeError(f"unknown setting {unknown[0]!r} (known: {', '.join(sorted(SETTING_NAMES))})")
        if settings is not None and not isinstance(settings, Settings):
            raise TypeError(f"settings must be an fp8convert.Settings, got {settings!r}; or pass keywords (scheme=...)")
        return replace(settings or cls(), **overrides)


SETTING_NAMES = frozenset(f.name for f in fields(Settings))  # what the CLI and jobs files pass to Settings
