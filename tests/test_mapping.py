"""Transforms on read (tsckpt/_base/mapping.py): rules resolved against stored leaves, and the
planner's pieces, which must be exactly the preimage of a target region."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tsckpt._base.mapping import Concat, MappingError, Reshape, Rule, Rules, Split, Transpose, place, plan
from tsckpt._errors import ShapeMismatchError, StructureMismatchError


def oracle(rule: Rule, stored: list[np.ndarray]) -> list[np.ndarray]:
    """The targets of ``rule`` computed with whole numpy arrays: what the planner must match."""
    views = rule.views
    arrays = list(stored)
    out: list[np.ndarray] = []
    for v in views:
        if isinstance(v, Concat):
            arrays = [np.concatenate(arrays, axis=v.axis)]
        elif isinstance(v, Split):
            a = arrays[0]
            n = a.shape[v.axis]
            sizes = v.parts if isinstance(v.parts, tuple) else (n // v.parts,) * v.parts
            arrays = np.split(a, np.cumsum(sizes)[:-1], axis=v.axis)
        elif isinstance(v, Transpose):
            arrays = [np.transpose(a, v.perm) for a in arrays]
        else:
            arrays = [a.reshape(v.shape) for a in arrays]
    out = arrays
    return out


@st.composite
def reshaped(draw: st.DrawFn, shape: tuple[int, ...]) -> Reshape:
    """A random shape with as many elements as ``shape``."""
    total = math.prod(shape)
    factors = [p for p in range(2, total + 1) for _ in range(_multiplicity(total, p))]
    factors = draw(st.permutations(factors))
    ndim = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, len(factors)), min_size=ndim - 1, max_size=ndim - 1)))
    groups = [factors[a:b] for a, b in zip([0, *cuts], [*cuts, len(factors)])]
    return Reshape(tuple(math.prod(g) for g in groups))


def _multiplicity(n: int, p: int) -> int:
    if any(p % q == 0 for q in range(2, p)):
        return 0
    k = 0
    while n % p == 0:
        n //= p
        k += 1
    return k


@st.composite
def cases(draw: st.DrawFn) -> tuple[Rule, list[np.ndarray]]:
    """A rule and its stored arrays (distinct values everywhere, so a misplaced element shows)."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    ndim = len(shape)
    kind = draw(st.sampled_from(["transpose", "reshape", "t+r", "r+t", "split", "concat"]))
    perm = tuple(draw(st.permutations(range(ndim))))
    sources = 1
    if kind == "transpose":
        views: tuple = (Transpose(perm),)
    elif kind == "reshape":
        views = (draw(reshaped(shape)),)
    elif kind == "t+r":
        views = (Transpose(perm), draw(reshaped(tuple(shape[p] for p in perm))))
    elif kind == "r+t":
        r = draw(reshaped(shape))
        views = (r, Transpose(tuple(draw(st.permutations(range(len(r.shape)))))))
    elif kind == "split":
        axis = draw(st.integers(0, ndim - 1))
        sizes = draw(st.lists(st.integers(1, 3), min_size=2, max_size=3))
        shape = tuple(sum(sizes) if d == axis else n for d, n in enumerate(shape))
        views = (Split(axis, tuple(sizes)), Transpose(perm))
        rule = Rule("s", tuple(f"t{i}" for i in range(len(sizes))), views)
        return rule, [np.arange(math.prod(shape)).reshape(shape)]
    else:
        sources = draw(st.integers(2, 3))
        axis = draw(st.integers(0, ndim - 1))
        views = (Transpose(perm), Concat(axis))
    stored = [np.arange(math.prod(shape)).reshape(shape) + i * 1000 for i in range(sources)]
    rule = Rule(tuple(f"s{i}" for i in range(sources)) if sources > 1 else "s", "t", views)
    return rule, stored


@given(cases(), st.data())
def test_pieces_are_exactly_the_preimage_of_the_target_region(case, data):
    rule, stored = case
    names = rule.stored_templates
    mapped = Rules([rule]).resolve({n: (a.shape, "int64") for n, a in zip(names, stored)})
    expected = dict(zip(rule.target_templates, oracle(rule, stored)))
    for target, whole in expected.items():
        leaf = mapped[target]
        assert leaf.shape == whole.shape
        offsets = tuple(data.draw(st.integers(0, n - 1)) for n in whole.shape)
        lengths = tuple(data.draw(st.integers(1, n - o)) for o, n in zip(offsets, whole.shape))
        region = np.full(lengths, -1, dtype=np.int64)
        pieces = plan(leaf, offsets, lengths)
        by_name = dict(zip(names, stored))
        for p in pieces:
            view = place(region, p.ops)
            assert view.shape == p.lengths
            assert np.shares_memory(view, region)  # a view, never a copy
            view[...] = by_name[p.source][tuple(slice(o, o + n) for o, n in zip(p.offsets, p.lengths))]
        want = whole[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
        np.testing.assert_array_equal(region, want)
        # exactly the preimage: every element read once, none read that the region lacks
        assert sum(math.prod(p.lengths) for p in pieces) == math.prod(lengths)


def test_torch_memory_takes_the_same_views():
    leaf = Rules([Rule("k", "w", Transpose((1, 0)))]).resolve({"k": ((4, 6), "float32")})["w"]
    stored = torch.arange(24.0).reshape(4, 6)
    region = torch.empty(3, 4)  # rows 2..4 of the (6, 4) target
    for p in plan(leaf, (2, 0), (3, 4)):
        assert p.source == "k" and p.offsets == (0, 2) and p.lengths == (4, 3)  # a column block of the stored
        place(region, p.ops).copy_(stored[:, 2:5])
    assert torch.equal(region, stored.T[2:5])


def test_templates_rename_with_wildcards_and_separators():
    rules = Rules([Rule("params/{m*}/kernel", "{m*}.weight", Transpose((1, 0)), sep=("/", ".")),
                     Rule("params/{m*}/bias", "{m*}.bias", sep=("/", "."))])
    out = rules.resolve({"params/blocks/0/kernel": ((2, 3), "float32"), "params/blocks/0/bias": ((3,), "float32"),
                         "other": ((1,), "int8")}, ["step"])
    assert list(out) == ["blocks.0.weight", "blocks.0.bias", "other", "step"]
    assert out["blocks.0.weight"].shape == (3, 2) and out["blocks.0.weight"].sources == ("params/blocks/0/kernel",)
    assert out["other"].rule is None and out["step"].is_value


def test_ndim_picks_the_rule():
    rules = Rules([Rule("{m}.weight", "{m}/scale", ndim=1), Rule("{m}.weight", "{m}/kernel", Transpose((1, 0)), ndim=2)])
    out = rules.resolve({"ln.weight": ((4,), "float32"), "fc.weight": ((5, 4), "float32")})
    assert out["ln/scale"].shape == (4,) and out["fc/kernel"].shape == (4, 5)


def test_two_rules_for_one_target_name_both():
    rules = Rules([Rule("a/{x}", "{x}"), Rule("b/{x}", "{x}")])
    with pytest.raises(MappingError) as e:
        rules.resolve({"a/w": ((2,), "float32"), "b/w": ((2,), "float32")})
    msg = str(e.value)
    assert "target 'w' is made twice" in msg and "'a/w'" in msg and "'b/w'" in msg and "Rule('a/{x}'" in msg
    assert isinstance(e.value, StructureMismatchError)


def test_a_missing_concat_source_names_rule_stored_and_target():
    rule = Rule(("{l}/q", "{l}/k"), "{l}.qk", Concat(0))
    with pytest.raises(MappingError, match=r"Rule\(.*stored 'a/q', target 'a.qk'.*'a/k' is not in the checkpoint"):
        Rules([rule]).resolve({"a/q": ((2, 2), "float32")})


def test_a_view_that_does_not_fit_names_rule_stored_and_target():
    with pytest.raises(ShapeMismatchError, match=r"stored 'k', target 'w'.*cannot reshape an array of shape \[2, 3\]"):
        Rules([Rule("k", "w", Reshape((4, 2)))]).resolve({"k": ((2, 3), "float32")})
    with pytest.raises(ShapeMismatchError, match=r"Split into 2 equal parts of axis 0 \(size 3\)"):
        Rules([Rule("k", ("a", "b"), Split(0, 2))]).resolve({"k": ((3, 3), "float32")})


def test_rules_are_checked_when_made():
    with pytest.raises(ValueError, match="need exactly one Concat"):
        Rule(("a", "b"), "c")
    with pytest.raises(ValueError, match="uses \\['y'\\], which the stored one lacks"):
        Rule("{x}", "{y}")
    with pytest.raises(ValueError, match="permutation"):
        Transpose((0, 0))
    with pytest.raises(TypeError, match="holds Rule objects"):
        Rules(["a"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"target is a template \(a str\) or several \(a tuple of str\), not \(1, 2\)"):
        Rule("a", (1, 2), Split(0, 2))  # type: ignore[arg-type]


def test_several_templates_and_views_may_be_given_as_lists():
    listed = Rule("qkv", ["q", "k", "v"], [Split(0, 3)])  # type: ignore[arg-type]
    assert listed == Rule("qkv", ("q", "k", "v"), Split(0, 3))
    assert Rule(["a", "b"], "ab", Concat(0)).stored == ("a", "b")  # type: ignore[arg-type]


def test_a_region_of_too_many_runs_is_refused_naming_the_rule():
    leaf = Rules([Rule("k", "w", Reshape((5000, 2)))]).resolve({"k": ((10000,), "float32")})["w"]
    assert len(plan(leaf, (0, 0), (5000, 2))) == 1  # whole: one piece
    assert len(plan(leaf, (10, 0), (20, 2))) == 1  # rows: one run
    with pytest.raises(MappingError, match=r"Rule\('k' -> 'w'.*stored 'k', target 'w'.*5000 separate runs"):
        plan(leaf, (0, 0), (5000, 1))


def test_unmatched_leaves_are_kept_or_dropped():
    arrays = {"model/l/kernel": ((2, 3), "float32"), "opt/mu/l/kernel": ((2, 3), "float32")}
    rule = Rule("model/{m*}/kernel", "{m*}.weight", Transpose((1, 0)), sep=("/", "."))
    assert list(Rules([rule]).resolve(arrays, ["step"])) == ["l.weight", "opt/mu/l/kernel", "step"]
    assert list(Rules([rule], unmatched="drop").resolve(arrays, ["step"])) == ["l.weight"]
    with pytest.raises(ValueError, match='"keep" or "drop"'):
        Rules([rule], unmatched="skip")


@pytest.mark.parametrize("views", [
    (Reshape((4, 6)), Transpose((1, 0))),  # reshape, then transpose: runs of a transposed view
    (Transpose((1, 2, 0)), Reshape((6, 4))),  # the same map, transpose first: contiguous runs
])
def test_an_attention_kernel_into_torch_memory_either_way(views):
    """Flax's (embed, heads, head_dim) kernel as torch's (heads * head_dim, embed) weight."""
    stored = torch.arange(24.0).reshape(4, 2, 3)
    leaf = Rules([Rule("k", "w", views)]).resolve({"k": ((4, 2, 3), "float32")})["w"]
    want = stored.reshape(4, 6).T
    for offsets, lengths in (((0, 0), (6, 4)), ((2, 0), (3, 4)), ((1, 1), (4, 2))):
        region = torch.full(lengths, -1.0)
        pieces = plan(leaf, offsets, lengths)
        for p in pieces:
            place(region, p.ops).copy_(stored[tuple(slice(o, o + n) for o, n in zip(p.offsets, p.lengths))])
        assert torch.equal(region, want[offsets[0] : offsets[0] + lengths[0], offsets[1] : offsets[1] + lengths[1]])
        assert sum(math.prod(p.lengths) for p in pieces) == math.prod(lengths)


def test_module_names_write_escaped_digit_keys_as_digits():
    """Orbax stores a list's items as the str keys "0", "12", "-1" (tsckpt's components
    %30, %312, %2D1): a rule turning paths into torch module names writes their digits; other
    components, and rules without sep, keep them as they are."""
    rules = Rules([Rule("{m*}/kernel", "{m*}.weight", sep=("/", ".")), Rule("{m*}/bias", "{m*}/b")])
    stored = {p: ((2,), "float32") for p in ("blocks/%30/kernel", "blocks/%312/mlp/kernel", "x/%2D1/kernel",
                                              "a%30/kernel", "blocks/%30/bias")}
    assert list(rules.resolve(stored)) == ["blocks.0.weight", "blocks.12.mlp.weight", "x.-1.weight", "a%30.weight",
                                           "blocks/%30/b"]
