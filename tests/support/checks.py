"""Assertions shared by the end-to-end tests: output tensors against expected ones, byte for byte."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(as_bytes(a), as_bytes(b))


def ignore_lists(fmt: str, cfg: dict) -> list[list[str]]:
    qc = cfg["quantization_config"]
    if fmt == "compressed-tensors":
        return [qc["ignore"]]
    return [qc["ignored_layers"], qc["modules_to_not_convert"]]


def assert_names_shapes_dtypes(got: dict, exp: dict):
    missing, extra = sorted(set(exp) - set(got)), sorted(set(got) - set(exp))
    assert not missing and not extra, f"missing tensors {missing[:8]}, unexpected tensors {extra[:8]}"
    bad = [
        (n, tuple(got[n].shape), got[n].dtype, tuple(e.shape), e.dtype)
        for n, e in exp.items()
        if tuple(got[n].shape) != tuple(e.shape) or got[n].dtype != e.dtype
    ]
    assert not bad, f"(name, got shape, got dtype, want shape, want dtype): {bad[:8]}"


def assert_codes_and_scales(got: dict, exp: dict, quantized: set):
    assert quantized, "nothing was expected to be quantized: the fixture is broken"
    wrong_codes, wrong_scales = [], []
    for n in quantized:
        g, e = got[n], exp[n]
        assert g.dtype == FP8, f"{n}: {g.dtype}"
        if not torch.equal(as_bytes(g), as_bytes(e)):
            diff = (as_bytes(g) != as_bytes(e)).sum().item()
            wrong_codes.append(f"{n} ({diff}/{e.numel()} codes differ)")
    for n, e in exp.items():
        if n.endswith((".weight_scale", ".weight_scale_inv")):
            g = got[n]
            if not same_bytes(g, e):
                wrong_scales.append(f"{n}: got {g.flatten()[:4].tolist()} want {e.flatten()[:4].tolist()}")
    assert not wrong_codes, f"FP8 codes differ from the reference: {wrong_codes[:6]}"
    assert not wrong_scales, f"scales differ from the reference: {wrong_scales[:6]}"


def assert_kept_identical(got: dict, src: dict, quantized: set):
    kept = [n for n in src if n not in quantized]
    bad = [n for n in kept if not same_bytes(got[n], src[n])]
    assert not bad, f"kept tensors not byte-identical to the source: {bad[:8]}"
