"""tsckpt.tree: leaf paths, escaping, custom nodes, structure JSON."""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import urllib.parse
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tsckpt
from tsckpt import tree
from tsckpt.tree import escape, flatten, structure_from_json, structure_to_json
from tests.conftest import examples

Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Adam:
    step: int
    moments: list


class Pair:
    """A user container registered with tsckpt.register_node."""

    def __init__(self, first, second):
        self.first, self.second = first, second


tsckpt.register_node(Pair, lambda p: ((p.first, p.second), None, ("first", 1)), lambda aux, ch: Pair(*ch))


def paths(t):
    return flatten(t).paths


# ---- paths of the built-in containers ------------------------------------------------


def test_dict_paths_are_sorted_and_nested():
    f = flatten({"b": 1, "a": {"y": 2, "x": 3}})
    assert f.paths == ["a/x", "a/y", "b"]
    assert f.leaves == [3, 2, 1]


def test_int_keys_and_sequence_indices_are_decimal():
    assert paths({0: "a", 10: "b", -2: "c"}) == ["-2", "0", "10"]
    assert paths([5, [6, 7]]) == ["0", "1/0", "1/1"]
    assert paths((5, (6,))) == ["0", "1/0"]


def test_namedtuple_and_dataclass_use_field_names():
    assert paths(Point(1, [2, 3])) == ["x", "y/0", "y/1"]
    f = flatten(Adam(step=4, moments=[torch.zeros(1)]))
    assert f.paths == ["step", "moments/0"]
    assert f.leaves[0] == 4


def test_none_and_empty_containers_have_no_leaves():
    assert paths(None) == []
    assert paths({}) == []
    assert paths([]) == []
    assert paths(()) == []
    assert paths({"a": None, "b": [], "c": {}, "d": 1}) == ["d"]


def test_single_leaf_tree_is_stored_at_root_path():
    assert paths(torch.ones(2)) == [tree.ROOT_LEAF_PATH] == ["%root"]
    assert paths(3) == ["%root"]


def test_custom_node_via_register_node():
    f = flatten({"p": Pair(np.arange(2), Pair(3, "x"))})
    assert f.paths == ["p/first", "p/1/first", "p/1/1"]
    assert f.leaves[1:] == [3, "x"]
    j = structure_to_json(f.spec)
    node = j["children"][0]
    assert node["type"] == "custom"
    assert node["class"].endswith("Pair")
    assert node["keys"] == ["first", 1]


def test_tsckpt_leaf_dataclasses_are_leaves_not_containers():
    spec = tsckpt.ArraySpec((2, 3), torch.float32)
    sharded = tsckpt.ShardedArray(np.zeros(2), (4,), (2,))
    f = flatten({"a": spec, "b": sharded})
    assert f.paths == ["a", "b"]
    assert f.leaves[0] is spec and f.leaves[1] is sharded


@pytest.mark.parametrize("key", [(1, 2), True, 1.5, b"k"])
def test_unnameable_keys_raise_leaf_type_error(key):
    with pytest.raises(tsckpt.LeafTypeError, match=rf"key .* of type {type(key).__name__} cannot name a checkpoint path"):
        flatten({"outer": {key: 1}})
    with pytest.raises(TypeError, match="at 'outer'"):
        flatten({"outer": {key: 1}})


# ---- escaping -------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, path",
    [
        ("plain_Name-1.2", "plain_Name-1.2"),
        ("a/b", "a%2Fb"),
        ("a.b", "a.b"),
        ("%", "%25"),
        ("a b", "a%20b"),
        ("é", "%C3%A9"),
        ("日本", "%E6%97%A5%E6%9C%AC"),
        ("", "%"),
        ("0", "%30"),
        ("-1", "%2D1"),
        ("007", "%3007"),
        ("zarr.json", "%7Aarr.json"),
        ("__x", "%5F_x"),
        ("_x", "_x"),
        (".", "%2E"),
        ("..", "%2E."),
        ("...", "%2E.."),
        (".a", ".a"),
        ("%root", "%25root"),
        ("a%2Fb", "a%252Fb"),
        ("c", "c"),
    ],
)
def test_escape(key, path):
    assert escape(key) == path
    assert paths({key: 1}) == [path]


def test_int_key_and_its_string_do_not_collide():
    f = flatten({0: "int", "0": "str", -1: "negint", "-1": "negstr"})
    assert dict(zip(f.paths, f.leaves)) == {"0": "int", "%30": "str", "-1": "negint", "%2D1": "negstr"}


def test_escaped_names_nest():
    assert paths({"a/b": {"c d": {"": 1}}}) == ["a%2Fb/c%20d/%"]


_VALID_NAME = re.compile(r"[A-Za-z0-9._%-]+")


def _is_valid_zarr_node_name(name: str) -> bool:
    # zarr v3: not empty, no "/", not only periods, no "__" prefix; escaped names are ASCII
    return bool(_VALID_NAME.fullmatch(name)) and name.strip(".") != "" and not name.startswith("__")


@settings(max_examples=examples(2))  # cheap: more strings
@given(st.text(max_size=12), st.text(max_size=12))
def test_escape_is_injective(a, b):
    if a != b:
        assert escape(a) != escape(b)


@settings(max_examples=examples(2))  # cheap: more strings
@given(st.text(max_size=12))
def test_escape_decodes_back_and_is_a_valid_zarr_name(key):
    e = escape(key)
    assert _is_valid_zarr_node_name(e), e
    if key:
        assert urllib.parse.unquote(e, errors="strict") == key
    # never mistaken for an integer key's component
    assert not re.fullmatch(r"-?[0-9]+", e)


keys = st.one_of(st.text(max_size=6), st.integers(-5, 50))


@given(st.dictionaries(keys, st.dictionaries(keys, st.integers(), max_size=4), max_size=4))
def test_distinct_keys_give_distinct_paths(d):
    f = flatten(d)
    assert len(set(f.paths)) == len(f.paths)
    expected = {(k1, k2) for k1, inner in d.items() for k2 in inner}
    assert len(f.paths) == len(expected)
    for p in f.paths:
        assert all(_is_valid_zarr_node_name(c) for c in p.split("/")), p


# ---- structure JSON -------------------------------------------------------------------


def _json_roundtrip(t):
    f = flatten(t)
    text = json.dumps(structure_to_json(f.spec), allow_nan=False)
    return structure_from_json(json.loads(text), f.leaves)


def test_structure_json_of_builtin_containers():
    f = flatten({"l": [1, (2,)], "n": None, "e": {}})
    assert structure_to_json(f.spec) == {
        "type": "dict",
        "keys": ["e", "l", "n"],
        "children": [
            {"type": "dict", "keys": [], "children": []},
            {"type": "list", "children": [None, {"type": "tuple", "children": [None]}]},
            {"type": "none"},
        ],
        "order": [1, 2, 0],  # insertion order l, n, e as indices into the sorted keys
    }


def test_structure_json_keeps_insertion_order():
    t = {"b": 1, "a": 2, 3: 4}
    out = _json_roundtrip(t)
    assert out == t and list(out) == ["b", "a", 3]


def test_structure_json_roundtrips_every_container():
    t = {
        "dict": {"z": 1, "y": [2, (3, None)]},
        "od": collections.OrderedDict([("b", 1), ("a", 2)]),
        "dq": collections.deque([1, 2]),
        "nt": Point(x=1, y="s"),
        "empty": [{}, [], ()],
        "mixed": {0: "a", "0": "b"},
    }
    out = _json_roundtrip(t)
    assert out["dict"] == t["dict"] and list(out["dict"]) == ["z", "y"]
    assert type(out["od"]) is collections.OrderedDict and list(out["od"].items()) == [("b", 1), ("a", 2)]
    assert type(out["dq"]) is collections.deque and list(out["dq"]) == [1, 2]
    # namedtuples come back as a namedtuple of the same name and fields, without importing the class
    assert type(out["nt"]).__name__ == "Point" and out["nt"]._fields == ("x", "y") and tuple(out["nt"]) == (1, "s")
    assert out["empty"] == [{}, [], ()] and type(out["empty"][2]) is tuple
    assert out["mixed"] == {0: "a", "0": "b"}


def test_structure_json_custom_nodes_and_dataclasses_become_dicts():
    out = _json_roundtrip({"adam": Adam(1, [2]), "pair": Pair(3, 4)})
    assert out == {"adam": {"step": 1, "moments": [2]}, "pair": {"first": 3, 1: 4}}


def test_structure_json_of_single_leaf_and_none():
    assert structure_to_json(flatten(5).spec) is None
    assert structure_from_json(None, [5]) == 5
    assert structure_to_json(flatten(None).spec) == {"type": "none"}
    assert structure_from_json({"type": "none"}, []) is None


def test_structure_from_json_rejects_extra_leaves():
    with pytest.raises(ValueError, match="structure has 1 leaves but 2 were given"):
        structure_from_json({"type": "list", "children": [None]}, [1, 2])


json_trees = st.recursive(
    st.integers() | st.text(max_size=4) | st.none(),
    lambda c: st.lists(c, max_size=3) | st.lists(c, max_size=3).map(tuple) | st.dictionaries(keys, c, max_size=3),
    max_leaves=12,
)


@given(json_trees)
def test_structure_json_roundtrip_property(t):
    out = _json_roundtrip(t)
    assert out == t
    assert repr(out) == repr(t)  # same container types and key order, all the way down


def test_structure_from_paths_makes_lists_of_index_runs():
    from tsckpt.tree import structure_from_json, structure_from_paths

    paths = ["a/0", "a/1/x", "b%2Fc", "d/%31"]  # "d/%31" is the str key "1", not an index
    s = structure_from_paths(paths)
    assert structure_from_json(s, [1, 2, 3, 4]) == {"a": [1, {"x": 2}], "b/c": 3, "d": {"1": 4}}
    assert structure_from_paths(["a/1", "b", "a/0"]) is None  # not depth-first: no structure claimed


def test_own_order_lists_leaves_as_the_tree_was_built():
    t = {"z": 1, "a": {"y": 2, "b": 3}, "m": [4, {"q": 5, "c": 6}]}
    flat = flatten(t)
    assert flat.leaves == [3, 2, 4, 6, 5, 1]  # dict keys sorted, as optree flattens
    order = tree.own_order(structure_to_json(flat.spec))
    assert [flat.leaves[i] for i in order] == [1, 2, 3, 4, 5, 6]
    assert tree.own_order(structure_to_json(flatten(7).spec)) == [0]


def test_structure_problem_walks_children_in_order_and_names_the_first_misplaced_leaf():
    node = {"type": "dict", "keys": ["a", "b/c"], "children": [None, {"type": "list", "children": [None, None]}]}
    assert tree.structure_problem(node, ["a", "b%2Fc/0", "b%2Fc/1"]) is None
    assert tree.structure_problem(node, ["a", "b%2Fc/0", "b%2Fc/2"]) == "its leaf 'b%2Fc/1' is listed in 'leaves' as 'b%2Fc/2'"
    assert tree.structure_problem(node, ["a"]) == "it has 3 leaves but the checkpoint lists 1"


def test_structure_problem_counts_no_leaves_below_a_none_node():
    # a None is rebuilt without its "children": counting them would misplace every later leaf
    node = {"type": "dict", "keys": ["a", "b"], "children": [{"type": "none", "children": [None]}, None]}
    assert tree.structure_problem(node, ["b"]) is None
    assert tree.structure_problem({"type": "dict", "keys": ["a"], "children": [{"type": "none", "children": 5}]}, []) is None


def test_structure_problem_refuses_deep_nesting_without_recursion():
    node: object = None
    for _ in range(tree.MAX_STRUCTURE_DEPTH + 1):
        node = {"type": "list", "children": [node]}
    assert tree.structure_problem(node, ["/".join(["0"] * (tree.MAX_STRUCTURE_DEPTH + 1))]) == (
        f"it is nested more than {tree.MAX_STRUCTURE_DEPTH} levels deep"
    )


class _Keyed:
    """A registered node whose children's names are its own data, not its structure's."""

    def __init__(self, names: list[str], values: list[Any]) -> None:
        self.names, self.values = names, values


tree.register_node(_Keyed, lambda n: (n.values, None, n.names), lambda aux, children: _Keyed([], list(children)))


def test_paths_are_remembered_by_structure_only_where_the_structure_names_them():
    first = flatten({"a": {"x": 1, "y": [2, 3]}, "p": Point(4, 5)})
    again = flatten({"a": {"x": 6, "y": [7, 8]}, "p": Point(9, 10)})
    assert again.paths == first.paths == ["a/x", "a/y/0", "a/y/1", "p/x", "p/y"]
    assert again.leaves == [6, 7, 8, 9, 10]
    assert flatten({"a": {"z": 1, "y": [2, 3]}, "p": Point(4, 5)}).paths[0] == "a/y/0"  # other keys
    # equal structures (optree does not compare a node's child names) with other names
    assert flatten({"k": _Keyed(["u", "v"], [1, 2])}).paths == ["k/u", "k/v"]
    assert flatten({"k": _Keyed(["s", "t"], [1, 2])}).paths == ["k/s", "k/t"]
