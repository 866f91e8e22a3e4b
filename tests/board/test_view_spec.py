"""Served dtypes per tensor name and Hugging Face shard layouts."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from deltaboard.board.contract.schemas import ViewRule, ViewSpec
from deltaboard.board.contract.view_spec import (
    INDEX_FILE,
    SINGLE_FILE,
    fp8_view,
    nbytes,
    plan_layout,
    served_dtype,
    unmatched_rules,
)


def test_floating_tensors_take_the_default_or_the_first_matching_rule() -> None:
    spec = ViewSpec(
        default_dtype="bf16",
        rules=(
            ViewRule(pattern="*.norm.weight", dtype="fp32"),
            ViewRule(pattern="lm_head.*", dtype="raw"),
            ViewRule(pattern="*.weight", dtype="fp16"),
        ),
    )
    assert served_dtype("model.norm.weight", "F32", spec) == "F32"
    assert served_dtype("lm_head.weight", "F32", spec) == "F32"
    assert served_dtype("lm_head.weight", "BF16", spec) == "BF16"
    assert served_dtype("layers.0.q.weight", "F32", spec) == "F16"
    assert served_dtype("layers.0.q.bias", "F32", spec) == "BF16"
    assert served_dtype("x", "F64", ViewSpec(default_dtype="fp32")) == "F32"


def test_rules_that_match_no_name_are_found() -> None:
    """A regular expression where a glob is meant (`.*` matches only names that start with
    a dot) and a case that differs match nothing, as `served_dtype` applies them."""
    rules = tuple(
        ViewRule(pattern=p, dtype="raw") for p in (".*", "*", "model.layers.*", "LM_HEAD.*", "lm_head.*")
    )
    names = ["model.layers.0.q_proj.weight", "lm_head.weight"]
    unmatched = unmatched_rules(names, ViewSpec(rules=rules))
    assert [rule.pattern for rule in unmatched] == [".*", "LM_HEAD.*"]
    for rule in unmatched:  # none of their tensors is served by them
        assert all(served_dtype(n, "F32", ViewSpec(rules=(rule,))) == "BF16" for n in names)
    assert unmatched_rules([], ViewSpec()) == []


def test_fp8_block_rules_serve_2d_weights_and_their_scales() -> None:
    spec = fp8_view("ue8m0", rules=(ViewRule(pattern="*.bias", dtype="fp32"),))
    assert served_dtype("l.0.q_proj.weight", "F32", spec, (64, 64)) == "F8_E4M3"
    assert served_dtype("l.0.q_proj.weight_scale_inv", "F32", spec, (1, 1)) == "F32"
    assert served_dtype("l.0.mlp.fc2.weight", "BF16", spec, (64, 300)) == "F8_E4M3"
    assert served_dtype("l.0.q_proj.bias", "F32", spec, (64,)) == "F32"
    assert served_dtype("odd_proj.weight", "F32", spec, (4, 4, 4)) == "BF16"  # not 2-D: next rule
    assert served_dtype("l.0.q_proj.weight", "F32", spec) == "BF16"  # no shape given: not 2-D
    for name in ("embed_tokens.weight", "lm_head.weight", "norm.weight", "embed_tokens.weight_scale_inv"):
        assert served_dtype(name, "F32", spec, (8, 8)) == "BF16"
    assert spec.rules[0].scale == "ue8m0" and spec.rules[-1].pattern == "*.bias"


def test_specs_without_fp8_rules_read_as_before() -> None:
    old = {"default_dtype": "bf16", "rules": [{"pattern": "*", "dtype": "raw"}], "shard_max_bytes": 5}
    assert ViewSpec.model_validate(old).rules[0] == ViewRule(pattern="*", dtype="raw")


def test_integer_and_fp8_tensors_pass_through() -> None:
    spec = ViewSpec(rules=(ViewRule(pattern="*", dtype="fp16"),))
    for dtype in ("I64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2"):
        assert served_dtype("buf", dtype, spec) == dtype


def test_one_file_when_everything_fits() -> None:
    layout = plan_layout([("a", "BF16", (4, 4)), ("b", "F32", ())], ViewSpec())
    assert layout.files == (SINGLE_FILE,)
    assert layout.placement == {"a": SINGLE_FILE, "b": SINGLE_FILE}
    assert layout.index is None
    assert INDEX_FILE == "model.safetensors.index.json"


def test_shards_are_cut_in_order_like_save_pretrained() -> None:
    tensors = [("a", "F32", (10,)), ("b", "F32", (10,)), ("big", "F32", (100,)), ("c", "BF16", (5,))]
    layout = plan_layout(tensors, ViewSpec(shard_max_bytes=80))
    assert layout.files == tuple(f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3))
    assert layout.placement == {
        "a": layout.files[0],
        "b": layout.files[0],
        "big": layout.files[1],
        "c": layout.files[2],
    }
    assert layout.index == {"metadata": {"total_size": 40 + 40 + 400 + 10}, "weight_map": layout.placement}


@given(
    st.lists(st.tuples(st.sampled_from(["BF16", "F32", "I64", "U8"]), st.integers(0, 50)), max_size=30),
    st.integers(1, 200),
)
def test_shards_respect_the_limit_and_keep_order(items: list[tuple[str, int]], limit: int) -> None:
    tensors = [(f"t{i}", dtype, (n,)) for i, (dtype, n) in enumerate(items)]
    layout = plan_layout(tensors, ViewSpec(shard_max_bytes=limit))
    assert list(layout.placement) == [name for name, _, _ in tensors]
    order = [layout.files.index(layout.placement[name]) for name, _, _ in tensors]
    assert order == sorted(order)
    for f in layout.files:
        members = [(d, s) for name, d, s in tensors if layout.placement[name] == f]
        assert members or not tensors
        assert len(members) == 1 or sum(nbytes(d, s) for d, s in members) <= limit
