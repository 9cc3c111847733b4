"""compact_targets: a recipe group's modules as few `re:` targets that match exactly them among every
module the model names (compressed-tensors gives a module the first group whose target matches it)."""

from __future__ import annotations

import re

import pytest

from fp8convert.plan.build import compact_targets


def matched(targets: list[str], every: set[str]) -> set[str]:
    return {m for m in every if any(m == t or (t.startswith("re:") and re.match(t[3:], m)) for t in targets)}


def experts(layers, ids, leaves=("gate_proj", "up_proj", "down_proj")) -> set[str]:
    return {f"model.layers.{i}.mlp.experts.{e}.{leaf}" for i in layers for e in ids for leaf in leaves}


ATTENTION = {f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}


def test_every_expert_of_every_layer_is_one_pattern():
    names = experts(range(4), range(64))
    targets = compact_targets(names, names | ATTENTION)
    assert len(targets) == 1 and matched(targets, names | ATTENTION) == names


@pytest.mark.parametrize(
    "names",
    [
        experts([1, 3], range(8)),  # some layers only: a layer number outside them must not match
        experts(range(4), range(8), leaves=("gate_proj", "up_proj")),  # not the down_proj beside them
        {"model.layers.0.self_attn.q_proj", "model.layers.2.self_attn.k_proj"},  # the product would overreach
        {"model.layers.1.self_attn.o_proj"},  # one module: itself
    ],
    ids=["some-layers", "some-leaves", "no-product", "single"],
)
def test_targets_match_exactly_the_modules_given(names):
    every = experts(range(4), range(8)) | ATTENTION
    targets = compact_targets(names, every)
    assert matched(targets, every) == names
    assert all(t.startswith("re:^") and t.endswith("$") for t in targets if t not in names)


def test_a_name_that_is_a_prefix_of_another_is_not_matched_by_it():
    """experts.1 must not match experts.10: the patterns are anchored at both ends."""
    names = {f"model.layers.0.mlp.experts.{e}.up_proj" for e in (1, 2)}
    every = names | {f"model.layers.0.mlp.experts.{e}.up_proj" for e in (10, 11, 12)}
    assert matched(compact_targets(names, every), every) == names
