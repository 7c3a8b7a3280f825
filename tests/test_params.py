"""Tests for lmjax.params: names, natural order, round trips, counts and masks (SPEC section 3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmjax import params as ptree
from lmjax.errors import ShapeError

D, V, F = 4, 7, 8
BLOCK_IDS = ("10", "0", "2", "1")  # deliberately not in natural order


def _block(i: int) -> dict:
    """One pre-norm transformer block; values depend on `i` so blocks are distinguishable."""
    base = float(i)
    return {
        "feed_forward": {
            "project": {"bias": jnp.full((D,), base), "weight": jnp.full((F, D), base + 0.5)},
            "expand": {"weight": jnp.full((D, F), base + 0.25), "bias": jnp.zeros((F,))},
        },
        "attention_norm": {"scale": jnp.ones((D,)), "bias": jnp.zeros((D,))},
        "attention": {
            name: {"weight": jnp.full((D, D), base + k), "bias": jnp.full((D,), -base - k)}
            for k, name in enumerate(("value", "query", "output", "key"))
        },
    }


def small_transformer() -> dict:
    return {
        "language_model_head": {"weight": jnp.arange(D * V, dtype=jnp.float32).reshape(D, V)},
        "final_norm": {"scale": jnp.ones((D,)), "bias": jnp.zeros((D,))},
        "blocks": {i: _block(int(i)) for i in BLOCK_IDS},
        "token_embedding": {"weight": jnp.arange(V * D, dtype=jnp.float32).reshape(V, D)},
        "position_embedding": {"weight": jnp.zeros((3, D))},
    }


BLOCK_LEAVES = [
    "attention.key.bias",
    "attention.key.weight",
    "attention.output.bias",
    "attention.output.weight",
    "attention.query.bias",
    "attention.query.weight",
    "attention.value.bias",
    "attention.value.weight",
    "attention_norm.bias",
    "attention_norm.scale",
    "feed_forward.expand.bias",
    "feed_forward.expand.weight",
    "feed_forward.project.bias",
    "feed_forward.project.weight",
]

# Written out by hand: natural order at every level (2 before 10), plain order elsewhere.
EXPECTED_NAMES = (
    [f"blocks.{i}.{leaf}" for i in (0, 1, 2, 10) for leaf in BLOCK_LEAVES]
    + ["final_norm.bias", "final_norm.scale", "language_model_head.weight"]
    + ["position_embedding.weight", "token_embedding.weight"]
)


def _assert_trees_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).shape == np.asarray(y).shape
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --------------------------------------------------------------------------- flatten / order


def test_flatten_names_in_natural_order():
    names = list(ptree.flatten(small_transformer()))
    assert names == EXPECTED_NAMES
    assert names.index("blocks.2.attention.key.bias") < names.index("blocks.10.attention.key.bias")


def test_flatten_values_are_the_leaves():
    tree = small_transformer()
    flat = ptree.flatten(tree)
    assert (
        flat["blocks.10.attention.query.weight"]
        is tree["blocks"]["10"]["attention"]["query"]["weight"]
    )
    np.testing.assert_array_equal(flat["blocks.2.attention.key.bias"], np.full((D,), -2.0 - 3))


def test_flatten_order_independent_of_insertion_order():
    tree = small_transformer()

    def reverse(node):
        if isinstance(node, dict):
            return {k: reverse(node[k]) for k in reversed(list(node))}
        return node

    assert list(ptree.flatten(reverse(tree))) == EXPECTED_NAMES


def test_flatten_order_same_after_tree_map():
    tree = small_transformer()
    mapped = jax.tree.map(lambda x: x * 2, tree)
    assert list(ptree.flatten(mapped)) == EXPECTED_NAMES
    np.testing.assert_array_equal(
        ptree.flatten(mapped)["token_embedding.weight"],
        2 * np.arange(V * D, dtype=np.float32).reshape(V, D),
    )


def test_flatten_is_deterministic():
    tree = small_transformer()
    assert list(ptree.flatten(tree)) == list(ptree.flatten(tree))


def test_flatten_order_ignores_insertion_for_numerically_equal_keys():
    # "1" and "01" are different valid keys with the same digit value; the module promises
    # the order "never depends on dict insertion order", so both dicts must flatten alike.
    a = ptree.flatten({"1": np.zeros(1), "01": np.ones(1)})
    b = ptree.flatten({"01": np.ones(1), "1": np.zeros(1)})
    assert list(a) == list(b)


def test_flatten_accepts_any_dotless_str_key():
    # "²" is a non-empty str without '.', so it is a valid key (str.isdigit() is True for it,
    # but it is not a decimal digit).
    flat = ptree.flatten({"x²": {"²": np.zeros(2)}, "b": np.ones(1)})
    assert set(flat) == {"x².²", "b"}


@pytest.mark.parametrize(
    "bad",
    [
        {0: np.zeros(1)},
        {"blocks": {0: np.zeros(1), "1": np.zeros(1)}},
        {"a.b": np.zeros(1)},
        {"outer": {"in.ner": np.zeros(1)}},
        {"": np.zeros(1)},
        {("a",): np.zeros(1)},
    ],
)
def test_flatten_rejects_bad_keys(bad):
    with pytest.raises(ShapeError) as info:
        ptree.flatten(bad)
    assert "expected" in str(info.value) and "Fix:" in str(info.value)


def test_flatten_rejects_int_key_and_names_it():
    with pytest.raises(ShapeError, match="blocks"):
        ptree.flatten({"blocks": {3: np.zeros(1)}})


# --------------------------------------------------------------------------- unflatten


def test_unflatten_inverts_flatten():
    tree = small_transformer()
    back = ptree.unflatten(ptree.flatten(tree))
    _assert_trees_equal(back, tree)
    assert set(back["blocks"]) == {"0", "1", "2", "10"}
    assert set(back["blocks"]["10"]["attention"]) == {"query", "key", "value", "output"}


def test_unflatten_handmade():
    x, y, z = np.zeros(1), np.ones(2), np.full(3, 2.0)
    out = ptree.unflatten({"a.b.c": x, "a.d": y, "e": z})
    assert set(out) == {"a", "e"}
    assert set(out["a"]) == {"b", "d"}
    assert out["a"]["b"]["c"] is x and out["a"]["d"] is y and out["e"] is z


@pytest.mark.parametrize(
    "flat",
    [
        {"a.b": 1, "a.b.c": 2},
        {"a.b.c": 2, "a.b": 1},
        {"x": 1, "x.y": 2},
        {"m.n.o.p": 1, "m.n": 2},
    ],
)
def test_unflatten_rejects_leaf_that_is_also_prefix(flat):
    with pytest.raises(ShapeError):
        ptree.unflatten(flat)


@pytest.mark.parametrize("name", ["a..b", ".a", "a.", ""])
def test_unflatten_rejects_empty_parts(name):
    with pytest.raises(ShapeError):
        ptree.unflatten({name: 1})


_KEY = st.text(alphabet="abcxyz_019", min_size=1, max_size=4)
_LEAF = st.builds(
    lambda shape, seed: np.asarray(
        np.random.default_rng(seed).standard_normal(shape), dtype=np.float32
    ),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.integers(0, 2**16),
)
_TREES = st.recursive(
    _LEAF,
    lambda children: st.dictionaries(_KEY, children, min_size=1, max_size=4),
    max_leaves=12,
).filter(lambda t: isinstance(t, dict))


@settings(max_examples=50, deadline=None)
@given(_TREES)
def test_roundtrip_property(tree):
    flat = ptree.flatten(tree)
    # Independent leaf count: jax sees the same leaves (numpy arrays are leaves).
    assert len(flat) == len(jax.tree.leaves(tree))
    for name in flat:
        assert all(part and "." not in part for part in name.split("."))
    back = ptree.unflatten(flat)
    _assert_trees_equal(back, tree)
    assert list(ptree.flatten(back)) == list(flat)


# --------------------------------------------------------------------------- count


def _expected_count() -> int:
    block = (
        4 * (D * D + D)  # query, key, value, output
        + 2 * D  # attention_norm
        + (D * F + F)  # expand
        + (F * D + D)  # project
    )
    return 4 * block + 2 * D + D * V + V * D + 3 * D


def test_count_real_arrays():
    tree = small_transformer()
    by_hand = sum(np.asarray(x).size for x in jax.tree.leaves(tree))
    assert by_hand == _expected_count()
    assert ptree.count(tree) == by_hand


def test_count_eval_shape():
    abstract = jax.eval_shape(small_transformer)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    assert ptree.count(abstract) == _expected_count()


def test_count_scalars_and_empty():
    assert (
        ptree.count({"a": jnp.zeros(()), "b": {"c": jnp.zeros((0, 5)), "d": jnp.zeros((2, 3))}})
        == 7
    )
    assert ptree.count({}) == 0


# --------------------------------------------------------------------------- mask


def _true_names(m) -> set[str]:
    return {name for name, v in ptree.flatten(m).items() if v}


def _check_mask(pattern, expected: set[str]) -> None:
    tree = small_transformer()
    m = ptree.mask(tree, pattern)
    assert jax.tree.structure(m) == jax.tree.structure(tree)
    assert all(type(v) is bool or isinstance(v, np.bool_) for v in jax.tree.leaves(m))
    assert _true_names(m) == expected


def test_mask_bias_glob():
    expected = {n for n in EXPECTED_NAMES if n.endswith(".bias")}
    assert len(expected) == 4 * 7 + 1
    _check_mask("*.bias", expected)


def test_mask_attention_of_every_block():
    expected = {
        f"blocks.{i}.attention.{p}.{w}"
        for i in (0, 1, 2, 10)
        for p in ("query", "key", "value", "output")
        for w in ("weight", "bias")
    }
    _check_mask("blocks.*.attention.*", expected)
    # attention_norm is not under "attention." and must stay False
    assert not any("attention_norm" in n for n in expected)


def test_mask_list_of_patterns():
    expected = {"token_embedding.weight", "final_norm.scale"} | {
        f"blocks.{i}.attention_norm.scale" for i in (0, 1, 2, 10)
    }
    _check_mask(["token_embedding.*", "*norm.scale"], expected)


def test_mask_single_string_equals_one_element_list():
    tree = small_transformer()
    assert ptree.mask(tree, "blocks.10.*") == ptree.mask(tree, ["blocks.10.*"])
    _check_mask("blocks.10.*", {f"blocks.10.{leaf}" for leaf in BLOCK_LEAVES})


def test_mask_is_case_sensitive_and_exact():
    _check_mask("*.BIAS", set())
    _check_mask("blocks.1.*", {f"blocks.1.{leaf}" for leaf in BLOCK_LEAVES})
    _check_mask([], set())


def test_mask_usable_with_tree_map():
    tree = small_transformer()
    m = ptree.mask(tree, "*.bias")
    zeroed = jax.tree.map(lambda x, keep: x * 0 if keep else x, tree, m)
    flat = ptree.flatten(zeroed)
    assert float(jnp.abs(flat["blocks.2.attention.key.bias"]).sum()) == 0.0
    np.testing.assert_array_equal(flat["blocks.2.attention.key.weight"], np.full((D, D), 2.0 + 3))


def test_mask_require_match_raises_naming_pattern():
    tree = small_transformer()
    with pytest.raises(ShapeError) as info:
        ptree.mask(tree, ["*.bias", "blocks.*.atention.*"], require_match=True)
    assert "blocks.*.atention.*" in str(info.value)
    with pytest.raises(ShapeError, match="nope"):
        ptree.mask(tree, "nope", require_match=True)


def test_mask_require_match_ok_when_all_match():
    tree = small_transformer()
    m = ptree.mask(tree, ["*.bias", "token_embedding.weight"], require_match=True)
    assert "token_embedding.weight" in _true_names(m)
    # Without require_match a non-matching pattern is silently fine.
    assert _true_names(ptree.mask(tree, "nope")) == set()


def test_matches_helper():
    assert ptree.matches("blocks.3.attention.query.bias", "*.bias")
    assert ptree.matches("blocks.3.attention.query.bias", ("x", "blocks.?.attention.*"))
    assert not ptree.matches("blocks.3.attention_norm.bias", "blocks.*.attention.*")


def test_natural_key_orders_numbers():
    names = ["b10", "b2", "a", "b1", "b"]
    assert sorted(names, key=ptree.natural_key) == ["a", "b", "b1", "b2", "b10"]


def test_mask_keeps_empty_subtrees_so_structures_match():
    tree = {"a": {}, "b": {"weight": jnp.ones(2)}}
    m = ptree.mask(tree, "*.weight")
    assert jax.tree.structure(m) == jax.tree.structure(tree)
    assert m == {"a": {}, "b": {"weight": True}}


def test_stored_name_inverts_layer_names():
    for name in ("blocks.attention.query.weight", "blocks.norm.scale"):
        assert {ptree.stored_name(n) for n in ptree.layer_names(name, 3)} == {name}
    # Only `blocks.<index>.` is a per-layer name; anything else is its own stored name.
    for name in ("blocks.attention.query.weight", "final_norm.scale", "blocks.7", "x.3.y"):
        assert ptree.stored_name(name) == name


def test_blocks_layout_tells_stacked_from_per_layer():
    leaf = np.zeros((2, 3))
    assert ptree.blocks_layout({"blocks": {"norm": {"scale": leaf}}}) == "stacked"
    assert ptree.blocks_layout({"blocks": {"0": {}, "1": {}}}) == "layers"
    assert ptree.blocks_layout({"blocks": {}}) is None
    assert ptree.blocks_layout({"final_norm": leaf}) is None
    assert ptree.blocks_layout(leaf) is None
    stacked = ptree.stack({"blocks": {"0": {"w": leaf[0]}, "1": {"w": leaf[1]}}})
    assert ptree.blocks_layout(stacked) == "stacked"
    assert ptree.blocks_layout(ptree.unstack(stacked)) == "layers"


def test_layers_matched_is_one_bool_per_layer():
    stacked = np.zeros((3, 2))
    assert ptree.layers_matched("blocks.w", stacked, "blocks.1.w") == (False, True, False)
    assert ptree.layers_matched("blocks.w", stacked, "blocks.w") == (True, True, True)
    assert ptree.layers_matched("final_norm.scale", stacked[0], "*.scale") == (True,)
    assert ptree.layers_matched("final_norm.scale", stacked[0], "blocks.*") == (False,)
