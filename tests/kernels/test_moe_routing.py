"""Block layout of the MoE expert backward (routing.py): invariants on adversarial routings, the
capacity bound, the errors of bad routings, and the tests' helper moekit.expert_routing."""
import numpy as np
import pytest
from moekit import ROUTINGS, expert_routing, make_routing

from nkilib.experimental.moe_mxfp8.routing import (build_block_layout, capacity_blocks, check_block_size,
                                                   validate_block_layout, validate_topk_ids, validate_topk_weights)


@pytest.mark.parametrize("block_size", [128, 256])
@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_layout_invariants(name, block_size):
    ids, e = make_routing(name, seed=1)
    t, k = ids.shape
    lay = build_block_layout(ids, e, block_size)
    b, n = block_size, lay.capacity
    assert lay.token_position_to_id.shape == lay.token_position_to_slot.shape == (n * b,)
    assert n == capacity_blocks(t, k, e, b)
    for arr in (lay.token_position_to_id, lay.token_position_to_slot, lay.block_to_expert, lay.expert_block_offsets):
        assert arr.dtype == np.int32
    validate_block_layout(lay)
    off = lay.expert_block_offsets
    counts = np.bincount(ids.ravel(), minlength=e)
    np.testing.assert_array_equal(np.diff(off), -(-counts // b))  # ceil(count / B) blocks per expert
    assert off[0] == 0 and off[-1] == lay.num_used_blocks <= n
    # every routed pair appears exactly once, in a block of its expert, with its token id
    slot = lay.token_position_to_slot
    valid = slot < t * k
    assert sorted(slot[valid].tolist()) == list(range(t * k))
    pos = np.flatnonzero(valid)
    np.testing.assert_array_equal(lay.block_to_expert[pos // b], ids.ravel()[slot[valid]])
    np.testing.assert_array_equal(lay.token_position_to_id[pos], slot[valid] // k)
    # padding: sentinels T / T*k together; unused blocks hold expert E and only padding
    np.testing.assert_array_equal(lay.token_position_to_id[~valid], t)
    np.testing.assert_array_equal(lay.block_to_expert[lay.num_used_blocks:], e)
    assert not valid[lay.num_used_blocks * b:].any()
    for ex in range(e):  # expert-major blocks, ascending tokens, padding only at the end of an expert
        p0, p1 = off[ex] * b, off[ex + 1] * b
        np.testing.assert_array_equal(lay.block_to_expert[off[ex]:off[ex + 1]], ex)
        toks = lay.token_position_to_id[p0:p1]
        c = counts[ex]
        assert np.all(np.diff(toks[:c]) > 0) and np.all(toks[c:] == t)


def test_capacity_is_reached_by_a_worst_case_routing():
    # three experts with one token each, the fourth with the rest: every expert wastes B - 1 or so
    t, e, b = 300, 4, 128
    ids = np.full((t, 1), 3, np.int32)
    ids[:3, 0] = [0, 1, 2]
    lay = build_block_layout(ids, e, b)
    assert lay.num_used_blocks == capacity_blocks(t, 1, e, b) == (t - e) // b + e == 6
    with pytest.raises(ValueError, match=r"capacity=5 blocks is too small: this routing needs 6 blocks of 128"):
        build_block_layout(ids, e, b, capacity=5)
    assert build_block_layout(ids, e, b, capacity=9).capacity == 9


@pytest.mark.parametrize("ids, match", [
    (np.array([[0, 4]], np.int32), r"topk_ids\[0, 1\] = 4 is out of range: expert ids must be in \[0, 4\)"),
    (np.array([[1, 0], [-1, 2]], np.int64), r"topk_ids\[1, 0\] = -1 is negative"),
    (np.array([[1, 2], [3, 3]], np.int32), r"topk_ids\[1\] = \[3, 3\] repeats expert 3 \(positions \[0, 1\]\)"),
    (np.array([0, 1], np.int32), r"must be a non-empty \[T, k\] array, got shape \(2,\)"),
    (np.zeros((1, 5), np.int32), r"k=5 experts per token but num_experts=4"),
])
def test_bad_ids_raise_value_error(ids, match):
    with pytest.raises(ValueError, match=match):
        build_block_layout(ids, 4)


@pytest.mark.parametrize("ids", [np.zeros((2, 1), np.float32), np.zeros((2, 1), np.uint8), [[0], [1]]])
def test_ids_of_wrong_type_raise_type_error(ids):
    with pytest.raises(TypeError, match="topk_ids must"):
        validate_topk_ids(ids, 4)


@pytest.mark.parametrize("b", [0, 64, 192, 640, 1.5, True])
def test_bad_block_size(b):
    with pytest.raises(ValueError, match="block_size must be"):
        check_block_size(b)


def test_weights_validation():
    w = np.ones((2, 2), np.float32)
    np.testing.assert_array_equal(validate_topk_weights(w, (2, 2)), w)
    w[1, 0] = np.nan
    with pytest.raises(ValueError, match=r"topk_weights\[1, 0\] = nan is not finite"):
        validate_topk_weights(w, (2, 2))
    with pytest.raises(ValueError, match=r"shape of topk_ids \(2, 3\), got \(2, 2\)"):
        validate_topk_weights(np.ones((2, 2)), (2, 3))
    with pytest.raises(ValueError, match=r"topk_weights\[0, 0\] = inf"):
        validate_topk_weights(np.array([[1e39]]), (1, 1))  # overflows float32
    with pytest.raises(TypeError, match="floating-point"):
        validate_topk_weights(np.ones((1, 1), np.int32), (1, 1))


def _corrupt(lay, field, fn):
    arr = getattr(lay, field).copy()
    fn(arr)
    return lay._replace(**{field: arr})


@pytest.mark.parametrize("field, fn, match", [
    ("block_to_expert", lambda a: a.__setitem__(0, 1), r"block_to_expert\[0\] = 1, but the offsets give expert 0"),
    ("expert_block_offsets", lambda a: a.__setitem__(1, a[2] + 1), r"expert_block_offsets must rise"),
    ("token_position_to_id", lambda a: a.__setitem__(0, a[0] + 1), r"position 0: token_position_to_id = \d+ and"),
    ("token_position_to_slot", lambda a: a.__setitem__(1, a[0]), r"appears 0 times|disagree"),
])
def test_corrupted_layouts_are_rejected(field, fn, match):
    ids, e = make_routing("random", seed=2)
    lay = build_block_layout(ids, e)
    with pytest.raises(ValueError, match=match):
        validate_block_layout(_corrupt(lay, field, fn))
    with pytest.raises(ValueError, match="int32 array of shape"):
        validate_block_layout(lay._replace(block_to_expert=lay.block_to_expert.astype(np.int64)))


def test_expert_routing_helper():
    """moekit.expert_routing (the MoE kernel tests' routing maker): counts[i] rows of experts[i], sorted by expert
    unless shuffle_seed draws one seeded permutation of those rows; a count per expert or ValueError."""
    ids = expert_routing([2, 0, 3], experts=[4, 1, 0])
    assert ids.dtype == np.int32 and ids.shape == (5, 1)
    assert ids[:, 0].tolist() == [4, 4, 0, 0, 0]
    shuffled = expert_routing([2, 0, 3], experts=[4, 1, 0], shuffle_seed=7)
    assert shuffled[:, 0].tolist() == ids[np.random.default_rng(7).permutation(5), 0].tolist()
    assert np.array_equal(shuffled, expert_routing([2, 0, 3], experts=[4, 1, 0], shuffle_seed=7))
    assert expert_routing([1, 2])[:, 0].tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="experts has 2 entries, counts 3: expected one count per expert"):
        expert_routing([1, 2, 3], experts=[0, 1])
