"""KeyedJaggedTensor / KeyedTensor / JaggedTensor and the dense EmbeddingBagCollection, on one process.

The jagged layout is TorchRec's: ``lengths`` is key-major (every sample of the
first key, then every sample of the next), ``values`` holds the bags in that
order. Every structural check is made against a hand-computed layout or a
plain-python model (``{key: [bag, bag, ...]}``) of the same data; the
collection's forward and backward are checked against ``F.embedding_bag`` and
per-feature ``nn.EmbeddingBag`` modules holding the same weights.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from shardwise_embedding._jagged import JaggedTensor, KeyedJaggedTensor
from shardwise_embedding._keyed_tensor import KeyedTensor
from shardwise_embedding._tables import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    PoolingType,
    check_tables,
    feature_order,
)
from torch import nn

# A model of a KJT: per key, one list of ids per sample (and, weighted, one list of weights per sample).
Bags = dict[str, list[list[int]]]
WBags = dict[str, list[list[float]]]


def _long(xs: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(xs), dtype=torch.int64)


def _flat(keys: Sequence[str], bags: dict[str, list[list]]) -> tuple[list, list[int]]:
    """``values`` and key-major ``lengths`` of a model."""
    values: list = []
    lengths: list[int] = []
    for k in keys:
        for bag in bags[k]:
            values.extend(bag)
            lengths.append(len(bag))
    return values, lengths


def _kjt(keys: Sequence[str], bags: Bags, weights: Optional[WBags] = None, **kw) -> KeyedJaggedTensor:
    values, lengths = _flat(keys, bags)
    w = None if weights is None else torch.tensor(_flat(keys, weights)[0], dtype=torch.float64)
    return KeyedJaggedTensor.from_lengths_sync(list(keys), _long(values), _long(lengths), weights=w, **kw)


def _assert_key(kjt: KeyedJaggedTensor, key: str, bags: list[list[int]], weights: Optional[list[list[float]]]) -> None:
    jt = kjt[key]
    assert [b.tolist() for b in jt.to_dense()] == bags
    assert jt.lengths().tolist() == [len(b) for b in bags]
    assert jt.values().tolist() == [i for b in bags for i in b]
    assert jt.offsets().tolist() == [sum(len(b) for b in bags[:i]) for i in range(len(bags) + 1)]
    if weights is None:
        assert jt.weights_or_none() is None
    else:
        w = jt.weights_or_none()
        assert w is not None
        assert w.tolist() == [x for b in weights for x in b]


def _assert_model(
    kjt: KeyedJaggedTensor, keys: Sequence[str], bags: Bags, stride: int, weights: Optional[WBags] = None
) -> None:
    """``kjt`` holds exactly the model ``bags`` (and ``weights``) for ``keys``, in that order."""
    assert kjt.keys() == list(keys)
    assert kjt.stride() == stride
    values, lengths = _flat(keys, bags)
    assert kjt.values().tolist() == values
    assert kjt.lengths().tolist() == lengths
    assert kjt.lengths().dtype == torch.int64
    assert kjt.offsets().tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    per_key = [sum(len(b) for b in bags[k]) for k in keys]
    assert kjt.length_per_key() == per_key
    assert kjt.offset_per_key() == [sum(per_key[:i]) for i in range(len(per_key) + 1)]
    if weights is None:
        assert kjt.weights_or_none() is None
    else:
        assert kjt.weights().tolist() == _flat(keys, weights)[0]
    for k in keys:
        _assert_key(kjt, k, bags[k], None if weights is None else weights[k])


# --- a hand-computed layout ------------------------------------------------------------------------------------------

# 3 keys, 2 samples. key-major lengths: a: [2, 0], b: [1, 3], c: [0, 1]
KEYS = ["a", "b", "c"]
BAGS: Bags = {"a": [[10, 11], []], "b": [[12], [13, 14, 15]], "c": [[], [16]]}
WEIGHTS: WBags = {"a": [[0.5, 1.5], []], "b": [[2.0], [3.0, 4.0, 5.0]], "c": [[], [6.0]]}
VALUES = [10, 11, 12, 13, 14, 15, 16]
LENGTHS = [2, 0, 1, 3, 0, 1]
WFLAT = [0.5, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0]


@pytest.fixture
def kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(KEYS, _long(VALUES), _long(LENGTHS))


@pytest.fixture
def wkjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        KEYS, _long(VALUES), _long(LENGTHS), weights=torch.tensor(WFLAT, dtype=torch.float64)
    )


def test_docstring_example() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=torch.tensor([1, 2, 7, 8, 9]), lengths=torch.tensor([2, 0, 1, 2])
    )
    assert [t.tolist() for t in kjt["b"].to_dense()] == [[7], [8, 9]]
    assert [t.tolist() for t in kjt["a"].to_dense()] == [[1, 2], []]


def test_hand_layout(kjt: KeyedJaggedTensor) -> None:
    assert kjt.keys() == KEYS
    assert list(kjt) == KEYS
    assert len(kjt) == 3
    assert kjt.stride() == 2
    assert kjt.values().tolist() == VALUES
    assert kjt.lengths().tolist() == LENGTHS
    assert kjt.offsets().tolist() == [0, 2, 2, 3, 6, 6, 7]
    assert kjt.offsets().dtype == torch.int64
    assert kjt.length_per_key() == [2, 4, 1]
    assert kjt.offset_per_key() == [0, 2, 6, 7]
    assert kjt.device == torch.device("cpu")
    assert kjt.weights_or_none() is None
    # per key: values, lengths and offsets slices of the flat layout
    a, b, c = kjt["a"], kjt["b"], kjt["c"]
    assert (a.values().tolist(), a.lengths().tolist(), a.offsets().tolist()) == ([10, 11], [2, 0], [0, 2, 2])
    assert (b.values().tolist(), b.lengths().tolist(), b.offsets().tolist()) == ([12, 13, 14, 15], [1, 3], [0, 1, 4])
    assert (c.values().tolist(), c.lengths().tolist(), c.offsets().tolist()) == ([16], [0, 1], [0, 0, 1])
    _assert_model(kjt, KEYS, BAGS, 2)
    assert "KeyedJaggedTensor" in repr(kjt) and "'b'" in repr(kjt)


def test_hand_layout_weighted(wkjt: KeyedJaggedTensor) -> None:
    _assert_model(wkjt, KEYS, BAGS, 2, WEIGHTS)
    assert wkjt["b"].weights_or_none().tolist() == [2.0, 3.0, 4.0, 5.0]
    assert wkjt["c"].weights_or_none().tolist() == [6.0]
    assert wkjt.weights().dtype == torch.float64


def test_weights_accessor_without_weights(kjt: KeyedJaggedTensor) -> None:
    with pytest.raises(ValueError, match="no weights"):
        kjt.weights()
    assert all(jt.weights_or_none() is None for jt in kjt.to_dict().values())


def test_from_offsets_round_trip(kjt: KeyedJaggedTensor, wkjt: KeyedJaggedTensor) -> None:
    for dtype in (torch.int64, torch.int32):
        again = KeyedJaggedTensor.from_offsets_sync(KEYS, _long(VALUES), kjt.offsets().to(dtype))
        _assert_model(again, KEYS, BAGS, 2)
        wagain = KeyedJaggedTensor.from_offsets_sync(
            KEYS, wkjt.values(), wkjt.offsets().to(dtype), weights=wkjt.weights()
        )
        _assert_model(wagain, KEYS, BAGS, 2, WEIGHTS)
    explicit = KeyedJaggedTensor.from_offsets_sync(KEYS, _long(VALUES), kjt.offsets(), stride=2)
    assert explicit.stride() == 2 and explicit.lengths().tolist() == LENGTHS


def test_int32_inputs_are_accepted_and_lengths_become_int64() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(
        KEYS, torch.tensor(VALUES, dtype=torch.int32), torch.tensor(LENGTHS, dtype=torch.int32)
    )
    assert kjt.lengths().dtype == torch.int64
    assert kjt.values().dtype == torch.int32
    _assert_model(kjt, KEYS, BAGS, 2)


def test_stride_inference_and_explicit_stride() -> None:
    # 2 keys x 3 samples
    lengths = _long([1, 0, 2, 0, 0, 1])
    values = _long(range(4))
    assert KeyedJaggedTensor.from_lengths_sync(["x", "y"], values, lengths).stride() == 3
    assert KeyedJaggedTensor.from_lengths_sync(["x", "y"], values, lengths, stride=3).stride() == 3
    # 3 keys x 2 samples: the same lengths read another way
    kjt = KeyedJaggedTensor.from_lengths_sync(["x", "y", "z"], values, lengths)
    assert kjt.stride() == 2
    assert kjt.length_per_key() == [1, 2, 1]
    with pytest.raises(ValueError, match=r"stride 2 needs 4"):
        KeyedJaggedTensor.from_lengths_sync(["x", "y"], values, lengths, stride=2)
    with pytest.raises(ValueError, match="stride"):
        KeyedJaggedTensor.from_offsets_sync(["x", "y"], values, _long([0, 1, 1, 3, 3, 3, 4]), stride=4)


def test_empty_bags() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], _long([]), _long([0, 0, 0, 0, 0, 0]))
    assert kjt.stride() == 3
    assert kjt.length_per_key() == [0, 0]
    assert kjt.offset_per_key() == [0, 0, 0]
    assert kjt.offsets().tolist() == [0] * 7
    for key in ("a", "b"):
        jt = kjt[key]
        assert jt.values().numel() == 0
        assert jt.lengths().tolist() == [0, 0, 0]
        assert [t.numel() for t in jt.to_dense()] == [0, 0, 0]
    empty = KeyedJaggedTensor.empty(["a", "b"], stride=3)
    _assert_model(empty, ["a", "b"], {"a": [[], [], []], "b": [[], [], []]}, 3)
    empty.validate()


def test_stride_zero_with_keys() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], _long([]), _long([]))
    assert kjt.stride() == 0
    assert kjt.length_per_key() == [0, 0]
    assert kjt.offset_per_key() == [0, 0, 0]
    assert kjt.offsets().tolist() == [0]
    assert kjt["b"].lengths().numel() == 0 and kjt["b"].to_dense() == []
    assert KeyedJaggedTensor.from_offsets_sync(["a", "b"], _long([]), _long([0])).stride() == 0


def test_zero_keys() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync([], _long([]), _long([]))
    assert kjt.keys() == [] and len(kjt) == 0 and list(kjt) == []
    assert kjt.stride() == 0
    assert kjt.length_per_key() == []
    assert kjt.offset_per_key() == [0]
    assert kjt.to_dict() == {}
    assert kjt.split([]) == []
    assert KeyedJaggedTensor.from_lengths_sync([], _long([]), _long([]), stride=3).stride() == 3
    assert KeyedJaggedTensor.from_offsets_sync([], _long([]), _long([0])).keys() == []
    # a length with no key to belong to
    with pytest.raises(ValueError, match="lengths has 1 entries"):
        KeyedJaggedTensor.from_lengths_sync([], _long([5]), _long([1]))


def test_empty_keeps_stride_with_keys() -> None:
    e = KeyedJaggedTensor.empty(["a"], stride=4)
    assert e.stride() == 4 and e.lengths().tolist() == [0, 0, 0, 0]
    assert KeyedJaggedTensor.empty().keys() == []


def test_empty_with_no_keys_keeps_stride() -> None:
    assert KeyedJaggedTensor.empty([], stride=4).stride() == 4


def test_getitem_unknown_key(kjt: KeyedJaggedTensor) -> None:
    with pytest.raises(KeyError, match="'zz'"):
        kjt["zz"]


def test_to_dict(wkjt: KeyedJaggedTensor) -> None:
    d = wkjt.to_dict()
    assert list(d) == KEYS
    for k, jt in d.items():
        assert isinstance(jt, JaggedTensor)
        assert [t.tolist() for t in jt.to_dense()] == BAGS[k]
        assert jt.weights_or_none().tolist() == [x for b in WEIGHTS[k] for x in b]


def test_split(wkjt: KeyedJaggedTensor) -> None:
    one, two = wkjt.split([1, 2])
    _assert_model(one, ["a"], BAGS, 2, WEIGHTS)
    _assert_model(two, ["b", "c"], BAGS, 2, WEIGHTS)
    parts = wkjt.split([0, 3, 0])
    assert [p.keys() for p in parts] == [[], KEYS, []]
    assert [p.stride() for p in parts] == [2, 2, 2]
    _assert_model(parts[1], KEYS, BAGS, 2, WEIGHTS)
    for p in parts:
        p.validate()
        assert p.values().numel() == (7 if p.keys() else 0)
        assert p.weights().numel() == p.values().numel()
    assert [p.keys() for p in wkjt.split([1, 1, 1])] == [["a"], ["b"], ["c"]]


@pytest.mark.parametrize("segments", [[1, 1], [4], [2, 2], [3, -1, 1], [-1, 4]])
def test_split_bad_segments(kjt: KeyedJaggedTensor, segments: list[int]) -> None:
    with pytest.raises(ValueError, match="segments"):
        kjt.split(segments)


def test_permute(wkjt: KeyedJaggedTensor) -> None:
    dropped = wkjt.permute([2, 0])
    _assert_model(dropped, ["c", "a"], BAGS, 2, WEIGHTS)
    dropped.validate()
    assert dropped.values().tolist() == [16, 10, 11]
    assert dropped.lengths().tolist() == [0, 1, 2, 0]
    repeated = wkjt.permute([1, 1, 0])
    assert repeated.keys() == ["b", "b", "a"]
    assert repeated.values().tolist() == [12, 13, 14, 15, 12, 13, 14, 15, 10, 11]
    assert repeated.lengths().tolist() == [1, 3, 1, 3, 2, 0]
    assert repeated.weights().tolist() == [2.0, 3.0, 4.0, 5.0, 2.0, 3.0, 4.0, 5.0, 0.5, 1.5]
    assert repeated.length_per_key() == [4, 4, 2]
    none = wkjt.permute([])
    assert none.keys() == [] and none.stride() == 2 and none.values().numel() == 0
    assert none.weights().numel() == 0
    none.validate()
    same = wkjt.permute([0, 1, 2])
    _assert_model(same, KEYS, BAGS, 2, WEIGHTS)


def test_permute_rejects_indices_out_of_range(kjt: KeyedJaggedTensor) -> None:
    for bad in ([-1], [3], [0, 7]):
        with pytest.raises(IndexError, match="not in 0..2"):
            kjt.permute(bad)


def test_stride_must_be_a_count() -> None:
    empty = torch.empty(0, dtype=torch.int64)
    for bad in (-1, 2.7, True):
        with pytest.raises(ValueError, match="stride"):
            KeyedJaggedTensor.from_lengths_sync([], empty, empty, stride=bad)


def test_select(wkjt: KeyedJaggedTensor) -> None:
    sel = wkjt.select(["c", "a"])
    _assert_model(sel, ["c", "a"], BAGS, 2, WEIGHTS)
    sel.validate()
    assert wkjt.select([]).keys() == []
    _assert_model(wkjt.select(KEYS), KEYS, BAGS, 2, WEIGHTS)
    with pytest.raises(KeyError, match="'zz'"):
        wkjt.select(["a", "zz"])


def test_concat(wkjt: KeyedJaggedTensor) -> None:
    left, right = wkjt.split([2, 1])
    again = KeyedJaggedTensor.concat([left, right])
    _assert_model(again, KEYS, BAGS, 2, WEIGHTS)
    # concat in another order: the keys follow the inputs
    swapped = KeyedJaggedTensor.concat([right, left])
    _assert_model(swapped, ["c", "a", "b"], BAGS, 2, WEIGHTS)
    assert KeyedJaggedTensor.concat([wkjt]).keys() == KEYS
    assert KeyedJaggedTensor.concat([]).keys() == []


def test_concat_errors(kjt: KeyedJaggedTensor, wkjt: KeyedJaggedTensor) -> None:
    other = KeyedJaggedTensor.from_lengths_sync(["d"], _long([1]), _long([1, 0, 0]))  # stride 3
    with pytest.raises(ValueError, match=r"strides \[2, 3\]"):
        KeyedJaggedTensor.concat([kjt, other])
    plain_d = KeyedJaggedTensor.from_lengths_sync(["d"], _long([1]), _long([1, 0]))
    with pytest.raises(ValueError, match="weighted"):
        KeyedJaggedTensor.concat([wkjt, plain_d])
    with pytest.raises(ValueError, match="distinct"):
        KeyedJaggedTensor.concat([kjt, kjt])


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_to_device(wkjt: KeyedJaggedTensor, device) -> None:
    moved = wkjt.to(device)
    assert moved is wkjt  # already there: itself, as Tensor.to returns the same tensor
    assert moved.device == torch.device("cpu")
    _assert_model(moved, KEYS, BAGS, 2, WEIGHTS)
    assert moved.weights().device == torch.device("cpu")
    plain = wkjt.select(["a"]).to(device, non_blocking=True)
    assert plain.keys() == ["a"] and plain.stride() == 2


def test_jagged_tensor_directly() -> None:
    jt = JaggedTensor(_long([1, 2, 3, 4]), _long([0, 3, 1]), weights=torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert [t.tolist() for t in jt.to_dense()] == [[], [1, 2, 3], [4]]
    assert jt.offsets().tolist() == [0, 0, 3, 4]
    assert jt.lengths().tolist() == [0, 3, 1]
    assert jt.values().tolist() == [1, 2, 3, 4]
    assert jt.weights_or_none().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert JaggedTensor(_long([]), _long([])).to_dense() == []
    assert JaggedTensor(_long([]), _long([])).offsets().tolist() == [0]
    assert JaggedTensor(_long([7]), _long([1])).weights_or_none() is None
    assert "JaggedTensor" in repr(jt)


# --- validation ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "values", "lengths", "weights", "error", "match"),
    [
        pytest.param(["a"], _long([1, 2, 3]), _long([1, 1]), None, ValueError, "add up to 2 but there are 3", id="sum"),
        pytest.param(["a"], _long([1]), _long([2, -1]), None, ValueError, ">= 0, got -1", id="negative"),
        pytest.param(["a", "b"], _long([1, 2, 3]), _long([1, 1, 1]), None, ValueError, "not a multiple", id="ragged"),
        pytest.param(["a"], torch.tensor([1.0, 2.0]), _long([1, 1]), None, TypeError, "values must hold integ", id="f"),
        pytest.param(["a"], torch.tensor([True]), _long([1]), None, TypeError, "values", id="bool-ids"),
        pytest.param(["a"], _long([1, 2]), torch.tensor([1.0, 1.0]), None, TypeError, "lengths", id="float-lengths"),
        pytest.param(["a"], _long([[1, 2]]), _long([2]), None, ValueError, "values must be 1-D", id="2d-values"),
        pytest.param(["a"], _long([1, 2]), _long([[1, 1]]), None, ValueError, "lengths must be 1-D", id="2d-lengths"),
        pytest.param(["a"], [1, 2], _long([1, 1]), None, TypeError, "values must be a torch.Tensor", id="list"),
        pytest.param(["a", "a"], _long([1, 2]), _long([1, 1]), None, ValueError, r"distinct.*'a'", id="dup-keys"),
        pytest.param(["a"], _long([1, 2]), _long([1, 1]), torch.ones(3), ValueError, "weights has 3", id="w-len"),
        pytest.param(["a"], _long([1, 2]), _long([1, 1]), torch.ones(1, 2), ValueError, "weights must be 1", id="w-2d"),
    ],
)
def test_from_lengths_rejects(keys, values, lengths, weights, error, match) -> None:
    with pytest.raises(error, match=match):
        KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=weights)


@pytest.mark.parametrize(
    ("offsets", "error", "match"),
    [
        pytest.param(_long([1, 2, 3]), ValueError, "start at 0, got 1", id="start"),
        pytest.param(_long([0, 3, 1]), ValueError, "must not decrease", id="decreasing"),
        pytest.param(_long([0, 1, 2]), ValueError, "add up to 2 but there are 3", id="short-end"),
        pytest.param(_long([0, 1, 4]), ValueError, "add up to 4 but there are 3", id="long-end"),
        pytest.param(_long([]), ValueError, "at least one entry", id="empty"),
        pytest.param(torch.tensor([0.0, 1.0, 3.0]), TypeError, "offsets", id="float"),
        pytest.param(_long([[0, 1, 3]]), ValueError, "offsets must be 1-D", id="2d"),
    ],
)
def test_from_offsets_rejects(offsets, error, match) -> None:
    with pytest.raises(error, match=match):
        KeyedJaggedTensor.from_offsets_sync(["a", "b"], _long([1, 2, 3]), offsets)


def test_constructor_needs_lengths_or_offsets() -> None:
    with pytest.raises(ValueError, match="lengths or offsets"):
        KeyedJaggedTensor(["a"], _long([1]))


def test_validate_on_constructed(kjt: KeyedJaggedTensor) -> None:
    kjt.validate()
    bad = KeyedJaggedTensor(["a"], _long([1, 2]), lengths=_long([1, 0]))  # not checked until validate()
    with pytest.raises(ValueError, match="add up to 1 but there are 2"):
        bad.validate()


# --- hypothesis: random KJTs against a python model ------------------------------------------------------------------


@st.composite
def _models(draw: st.DrawFn) -> tuple[list[str], Bags, Optional[WBags], int]:
    n_keys = draw(st.integers(1, 5))
    stride = draw(st.integers(0, 6))
    keys = draw(st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=n_keys, max_size=n_keys, unique=True))
    lens = draw(st.lists(st.integers(0, 4), min_size=n_keys * stride, max_size=n_keys * stride))
    weighted = draw(st.booleans())
    bags: Bags = {}
    weights: WBags = {}
    counter = 0
    for ki, k in enumerate(keys):
        bags[k], weights[k] = [], []
        for b in range(stride):
            n = lens[ki * stride + b]
            bags[k].append(list(range(counter, counter + n)))  # every id distinct: misplaced ids show
            weights[k].append([0.25 * i for i in range(counter, counter + n)])
            counter += n
    return keys, bags, (weights if weighted else None), stride


@settings(max_examples=60, deadline=None)
@given(model=_models())
def test_random_kjt_matches_model(model) -> None:
    keys, bags, weights, stride = model
    kjt = _kjt(keys, bags, weights)
    _assert_model(kjt, keys, bags, stride, weights)
    # the same bags from offsets, and with the stride given
    again = KeyedJaggedTensor.from_offsets_sync(keys, kjt.values(), kjt.offsets(), weights=kjt.weights_or_none())
    _assert_model(again, keys, bags, stride, weights)
    _assert_model(_kjt(keys, bags, weights, stride=stride), keys, bags, stride, weights)
    assert list(kjt.to_dict()) == keys
    # the per-key views tile values: key k's ids sit at offset_per_key[k] .. offset_per_key[k + 1]
    opk = kjt.offset_per_key()
    for i, k in enumerate(keys):
        assert kjt.values()[opk[i] : opk[i + 1]].tolist() == kjt[k].values().tolist()


@settings(max_examples=60, deadline=None)
@given(model=_models(), data=st.data())
def test_random_permute_split_select(model, data) -> None:
    keys, bags, weights, stride = model
    kjt = _kjt(keys, bags, weights)
    n = len(keys)

    idx = data.draw(st.lists(st.integers(0, n - 1), max_size=7), label="indices")
    perm = kjt.permute(idx)
    want_keys = [keys[i] for i in idx]
    assert perm.keys() == want_keys
    assert perm.stride() == stride
    assert perm.values().tolist() == _flat(want_keys, bags)[0]
    assert perm.lengths().tolist() == _flat(want_keys, bags)[1]
    if weights is not None:
        assert perm.weights().tolist() == _flat(want_keys, weights)[0]
    if len(set(idx)) == len(idx):
        _assert_model(perm, want_keys, bags, stride, weights)

    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=4), label="cuts"))
    bounds = [0, *cuts, n]
    segments = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    parts = kjt.split(segments)
    assert len(parts) == len(segments)
    for part, lo, hi in zip(parts, bounds[:-1], bounds[1:], strict=True):
        part.validate()
        _assert_model(part, keys[lo:hi], bags, stride, weights)
    joined = KeyedJaggedTensor.concat(parts)
    _assert_model(joined, keys, bags, stride, weights)

    chosen = data.draw(st.permutations(keys), label="order")[: data.draw(st.integers(0, n), label="count")]
    sel = kjt.select(chosen)
    sel.validate()
    _assert_model(sel, chosen, bags, stride, weights)


# --- KeyedTensor -----------------------------------------------------------------------------------------------------


def test_keyed_tensor() -> None:
    values = torch.arange(3 * 6, dtype=torch.float64).reshape(3, 6)
    kt = KeyedTensor(["x", "y", "z"], [2, 3, 1], values)
    assert kt.keys() == ["x", "y", "z"]
    assert kt.values() is values
    assert kt.values().shape == (3, 6)
    assert kt.length_per_key() == [2, 3, 1]
    assert kt.offset_per_key() == [0, 2, 5, 6]
    assert kt.key_dim() == 1
    torch.testing.assert_close(kt["x"], values[:, 0:2])
    torch.testing.assert_close(kt["y"], values[:, 2:5])
    torch.testing.assert_close(kt["z"], values[:, 5:6])
    d = kt.to_dict()
    assert list(d) == ["x", "y", "z"]
    assert [t.shape for t in d.values()] == [(3, 2), (3, 3), (3, 1)]
    # views: they share the values' storage
    for t in d.values():
        assert t.untyped_storage().data_ptr() == values.untyped_storage().data_ptr()
    d["y"][1, 1] = -1.0
    assert values[1, 3] == -1.0
    with pytest.raises(KeyError, match="'w'"):
        kt["w"]
    assert "KeyedTensor" in repr(kt)
    # the lists handed back are copies
    kt.keys().append("q")
    kt.length_per_key().append(9)
    assert kt.keys() == ["x", "y", "z"] and kt.length_per_key() == [2, 3, 1]


def test_keyed_tensor_empty() -> None:
    kt = KeyedTensor([], [], torch.empty(4, 0))
    assert kt.offset_per_key() == [0]
    assert kt.to_dict() == {}


# --- EmbeddingBagConfig and check_tables -----------------------------------------------------------------------------


def _cfg(**kw) -> EmbeddingBagConfig:
    args = dict(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])
    args.update(kw)
    return EmbeddingBagConfig(**args)


@pytest.mark.parametrize(
    ("pooling", "want"),
    [("sum", "sum"), ("mean", "mean"), (PoolingType.SUM, "sum"), (PoolingType.MEAN, "mean")],
)
def test_config_pooling(pooling, want: str) -> None:
    cfg = _cfg(pooling=pooling)
    assert cfg.pooling == want
    assert PoolingType(cfg.pooling).value == want


def test_config_defaults_and_normalisation() -> None:
    cfg = _cfg(feature_names=["f", "g"])
    assert cfg.pooling == "sum" and cfg.dtype == torch.float32
    assert cfg.feature_names == ("f", "g")
    assert cfg.bytes == 10 * 4 * 4
    assert _cfg(dtype=torch.float64).bytes == 10 * 4 * 8
    assert _cfg(dtype=torch.float16).bytes == 10 * 4 * 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.name = "other"  # type: ignore[misc]
    assert hash(cfg) == hash(_cfg(feature_names=("f", "g")))


@pytest.mark.parametrize("pooling", ["max", "SUM", "", None, 1])
def test_config_bad_pooling(pooling) -> None:
    with pytest.raises(ValueError, match=r"table 't': pooling must be 'sum' or 'mean'"):
        _cfg(pooling=pooling)


@pytest.mark.parametrize("name", ["", "a.b", ".", None, 3])
def test_config_bad_name(name) -> None:
    with pytest.raises(ValueError, match="name must be a non-empty string without '.'"):
        _cfg(name=name)


@pytest.mark.parametrize("field", ["num_embeddings", "embedding_dim"])
@pytest.mark.parametrize("value", [0, -1, True, False, 2.0, "3", None])
def test_config_bad_sizes(field: str, value) -> None:
    with pytest.raises(ValueError, match=rf"table 't': {field} must be an int >= 1, got {value!r}"):
        _cfg(**{field: value})


def test_config_sizes_of_one_are_fine() -> None:
    cfg = _cfg(num_embeddings=1, embedding_dim=1)
    assert cfg.bytes == 4


@pytest.mark.parametrize("features", [[], ()])
def test_config_no_features(features) -> None:
    with pytest.raises(ValueError, match="table 't' has no feature_names"):
        _cfg(feature_names=features)


def test_config_duplicate_features() -> None:
    with pytest.raises(ValueError, match=r"table 't' names a feature twice: \['f', 'g', 'f'\]"):
        _cfg(feature_names=["f", "g", "f"])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_config_non_float_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=rf"table 't': dtype must be a floating type, got {dtype}"):
        _cfg(dtype=dtype)


def test_check_tables() -> None:
    t0 = _cfg(name="t0", feature_names=["f0", "f1"])
    t1 = _cfg(name="t1", feature_names=["f2"])
    check_tables([t0, t1])
    check_tables([])
    with pytest.raises(ValueError, match="two tables are named 't0'"):
        check_tables([t0, _cfg(name="t0", feature_names=["g"])])
    with pytest.raises(ValueError, match=r"feature 'f1' is claimed by tables 't0' and 't2'"):
        check_tables([t0, t1, _cfg(name="t2", feature_names=["g", "f1"])])
    with pytest.raises(TypeError, match="must be EmbeddingBagConfig, got dict"):
        check_tables([t0, {"name": "t9"}])  # type: ignore[list-item]
    # the collection checks its tables the same way
    with pytest.raises(ValueError, match=r"claimed by tables 't0' and 't2'"):
        EmbeddingBagCollection([t0, _cfg(name="t2", feature_names=["f0"])])
    assert [(f, t.name) for f, t in feature_order([t1, t0])] == [("f2", "t1"), ("f0", "t0"), ("f1", "t0")]


# --- EmbeddingBagCollection ------------------------------------------------------------------------------------------


def _tables(pooling: str = "sum") -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig("t0", 3, 7, ["f0"], pooling=pooling, dtype=torch.float64),
        EmbeddingBagConfig("t1", 2, 5, ["f1", "f2"], pooling=pooling, dtype=torch.float64),  # shared
        EmbeddingBagConfig("t2", 4, 2, ["f3"], pooling=pooling, dtype=torch.float64),
    ]


def _ebc(tables: list[EmbeddingBagConfig], seed: int = 0) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables)
    with torch.no_grad():
        for t in tables:
            ebc.embedding_bags[t.name].weight.copy_(torch.randn(t.num_embeddings, t.embedding_dim, dtype=t.dtype))
    return ebc


# 3 samples; the input's keys deliberately not in the tables' order
EBC_KEYS = ["f3", "f1", "f0", "f2"]
EBC_BAGS: Bags = {
    "f0": [[0, 6, 6], [], [3]],
    "f1": [[4], [0, 1, 2, 3], []],
    "f2": [[], [], [1, 1]],
    "f3": [[1], [0, 1], []],
}
EBC_WEIGHTS: WBags = {k: [[0.5 + 0.25 * j for j in range(len(b))] for b in bags] for k, bags in EBC_BAGS.items()}


def _reference(ebc: EmbeddingBagCollection, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
    out = {}
    for f, t in feature_order(ebc.embedding_bag_configs()):
        jt = kjt[f]
        out[f] = F.embedding_bag(
            jt.values(),
            ebc.embedding_bags[t.name].weight,
            jt.offsets()[:-1],
            mode=t.pooling,
            per_sample_weights=jt.weights_or_none(),
        )
    return out


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_forward_matches_embedding_bag(pooling: str) -> None:
    ebc = _ebc(_tables(pooling))
    kjt = _kjt(EBC_KEYS, EBC_BAGS)
    kt = ebc(kjt)
    assert isinstance(kt, KeyedTensor)
    assert kt.keys() == ["f0", "f1", "f2", "f3"]  # table by table, each table's features in order
    assert kt.length_per_key() == [3, 2, 2, 4]
    assert kt.offset_per_key() == [0, 3, 5, 7, 11]
    assert kt.values().shape == (3, 11)
    assert kt.values().dtype == torch.float64
    want = _reference(ebc, kjt)
    for f in kt.keys():
        torch.testing.assert_close(kt[f], want[f])
    torch.testing.assert_close(kt.values(), torch.cat([want[f] for f in kt.keys()], dim=1))
    # by hand, for a couple of bags
    w0 = ebc.embedding_bags["t0"].weight.detach()
    w1 = ebc.embedding_bags["t1"].weight.detach()
    pool = (lambda rows: rows.sum(0)) if pooling == "sum" else (lambda rows: rows.mean(0))
    torch.testing.assert_close(kt["f0"][0].detach(), pool(w0[[0, 6, 6]]))
    torch.testing.assert_close(kt["f1"][1].detach(), pool(w1[[0, 1, 2, 3]]))
    torch.testing.assert_close(kt["f2"][2].detach(), pool(w1[[1, 1]]))
    # empty bags pool to zeros
    for f, b in [("f0", 1), ("f1", 2), ("f2", 0), ("f2", 1), ("f3", 2)]:
        assert torch.equal(kt[f][b].detach(), torch.zeros_like(kt[f][b]))


def test_forward_weighted_sum() -> None:
    ebc = _ebc(_tables("sum"), seed=1)
    kjt = _kjt(EBC_KEYS, EBC_BAGS, EBC_WEIGHTS)
    kt = ebc(kjt)
    want = _reference(ebc, kjt)
    for f in kt.keys():
        torch.testing.assert_close(kt[f], want[f])
    w0 = ebc.embedding_bags["t0"].weight.detach()
    torch.testing.assert_close(kt["f0"][0].detach(), 0.5 * w0[0] + 0.75 * w0[6] + 1.0 * w0[6])
    # the weights matter
    unweighted = ebc(_kjt(EBC_KEYS, EBC_BAGS))
    assert not torch.allclose(kt.values(), unweighted.values())


def test_forward_int32_ids_and_key_order_independence() -> None:
    ebc = _ebc(_tables())
    kjt = _kjt(EBC_KEYS, EBC_BAGS)
    ordered = kjt.select(["f0", "f1", "f2", "f3"])
    as_int32 = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values().to(torch.int32), kjt.lengths())
    base = ebc(kjt).values()
    torch.testing.assert_close(ebc(ordered).values(), base)
    torch.testing.assert_close(ebc(as_int32).values(), base)


def test_forward_all_empty_and_stride_zero() -> None:
    ebc = _ebc(_tables())
    kt = ebc(KeyedJaggedTensor.empty(EBC_KEYS, stride=2))
    assert kt.values().shape == (2, 11)
    assert torch.equal(kt.values().detach(), torch.zeros(2, 11, dtype=torch.float64))
    kt0 = ebc(KeyedJaggedTensor.from_lengths_sync(EBC_KEYS, _long([]), _long([])))
    assert kt0.values().shape == (0, 11)
    assert kt0.keys() == ["f0", "f1", "f2", "f3"]
    assert [t.shape for t in kt0.to_dict().values()] == [(0, 3), (0, 2), (0, 2), (0, 4)]


def test_no_tables() -> None:
    ebc = EmbeddingBagCollection([])
    assert ebc.feature_names() == [] and ebc.embedding_bag_configs() == []
    kt = ebc(KeyedJaggedTensor.from_lengths_sync([], _long([]), _long([])))
    assert kt.keys() == [] and kt.values().shape == (0, 0)


def test_collection_structure() -> None:
    tables = _tables()
    ebc = EmbeddingBagCollection(tables)
    assert ebc.feature_names() == ["f0", "f1", "f2", "f3"]
    assert ebc.embedding_bag_configs() == tables
    assert ebc.embedding_bag_configs() is not ebc.embedding_bag_configs()
    sd = ebc.state_dict()
    assert list(sd) == ["embedding_bags.t0.weight", "embedding_bags.t1.weight", "embedding_bags.t2.weight"]
    assert [tuple(v.shape) for v in sd.values()] == [(7, 3), (5, 2), (2, 4)]
    assert all(v.dtype == torch.float64 for v in sd.values())
    assert [ebc.embedding_bags[t.name].mode for t in _tables("mean")] == ["sum"] * 3
    assert [m.mode for m in EmbeddingBagCollection(_tables("mean")).embedding_bags.values()] == ["mean"] * 3
    meta = EmbeddingBagCollection(tables, device="meta")
    assert all(p.device.type == "meta" for p in meta.parameters())


def test_forward_unknown_key() -> None:
    ebc = _ebc(_tables())
    kjt = KeyedJaggedTensor.concat([_kjt(EBC_KEYS, EBC_BAGS), _kjt(["zz"], {"zz": [[1], [], []]})])
    with pytest.raises(KeyError, match=r"\['zz'\] have no table"):
        ebc(kjt)


def test_forward_missing_feature() -> None:
    ebc = _ebc(_tables())
    kjt = _kjt(EBC_KEYS, EBC_BAGS).select(["f0", "f1", "f3"])
    with pytest.raises(KeyError, match=r"lacks features \['f2'\]"):
        ebc(kjt)


@pytest.mark.parametrize(
    ("feature", "bad", "table", "rows"),
    [("f0", -1, "t0", 7), ("f0", 7, "t0", 7), ("f2", 5, "t1", 5), ("f3", 2, "t2", 2), ("f3", -3, "t2", 2)],
)
def test_forward_id_out_of_range(feature: str, bad: int, table: str, rows: int) -> None:
    ebc = _ebc(_tables())
    bags = {k: [list(b) for b in v] for k, v in EBC_BAGS.items()}
    bags[feature][1].append(bad)
    with pytest.raises(IndexError) as info:
        ebc(_kjt(EBC_KEYS, bags))
    msg = str(info.value)
    assert f"feature {feature!r}" in msg
    assert f"table {table!r}" in msg
    assert f"id {bad}" in msg
    assert f"0..{rows - 1}" in msg


@pytest.mark.parametrize("bad_input", [{"f0": torch.tensor([1])}, torch.tensor([1, 2]), None])
def test_forward_not_a_kjt(bad_input) -> None:
    ebc = _ebc(_tables())
    with pytest.raises(TypeError, match="must be a KeyedJaggedTensor"):
        ebc(bad_input)


@st.composite
def _ebc_cases(draw: st.DrawFn):
    n_tables = draw(st.integers(1, 3))
    pooling = draw(st.sampled_from(["sum", "mean"]))
    tables, fid = [], 0
    for i in range(n_tables):
        n_feat = draw(st.integers(1, 2))
        feats = [f"f{fid + j}" for j in range(n_feat)]
        fid += n_feat
        tables.append(
            EmbeddingBagConfig(
                f"t{i}",
                draw(st.integers(1, 3)),
                draw(st.integers(1, 6)),
                feats,
                pooling=pooling,
                dtype=torch.float64,
            )
        )
    stride = draw(st.integers(0, 4))
    weighted = pooling == "sum" and draw(st.booleans())
    bags: Bags = {}
    weights: WBags = {}
    for f, t in feature_order(tables):
        bags[f] = [
            draw(st.lists(st.integers(0, t.num_embeddings - 1), max_size=3), label=f"{f} bag") for _ in range(stride)
        ]
        weights[f] = [[draw(st.floats(-2, 2), label="w") for _ in b] for b in bags[f]]
    keys = draw(st.permutations([f for f, _ in feature_order(tables)]), label="input key order")
    return tables, stride, keys, bags, (weights if weighted else None), draw(st.integers(0, 2**16), label="seed")


@settings(max_examples=30, deadline=None)
@given(case=_ebc_cases())
def test_backward_matches_per_feature_embedding_bags(case) -> None:
    tables, stride, keys, bags, weights, seed = case
    ebc = _ebc(tables, seed=seed)
    kjt = _kjt(keys, bags, weights)
    kt = ebc(kjt)
    dim = sum(t.embedding_dim * len(t.feature_names) for t in tables)
    assert kt.values().shape == (stride, dim)

    # per feature, its own nn.EmbeddingBag holding a copy of its table's weights
    refs: dict[str, nn.EmbeddingBag] = {}
    for f, t in feature_order(tables):
        w = ebc.embedding_bags[t.name].weight.detach().clone()
        refs[f] = nn.EmbeddingBag.from_pretrained(w, freeze=False, mode=t.pooling)
    want = []
    for f in kt.keys():
        jt = kjt[f]
        want.append(refs[f](jt.values(), jt.offsets()[:-1], per_sample_weights=jt.weights_or_none()))
    want_values = torch.cat(want, dim=1) if want else torch.empty(stride, 0, dtype=torch.float64)
    torch.testing.assert_close(kt.values(), want_values)

    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(stride, dim, generator=gen, dtype=torch.float64)
    (kt.values() * grad).sum().backward()
    (want_values * grad).sum().backward()
    for t in tables:
        got = ebc.embedding_bags[t.name].weight.grad
        expected = sum(refs[f].weight.grad for f in t.feature_names)
        torch.testing.assert_close(got, expected)


def test_weights_must_be_floating_point() -> None:
    with pytest.raises(TypeError, match="floating point"):
        KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1]), torch.tensor([1]), weights=torch.tensor([2]))


def test_feature_names_as_one_string_is_an_error() -> None:
    with pytest.raises(TypeError, match="list of names"):
        EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=3, feature_names="user")


def test_weights_with_mean_pooling_fail_before_any_lookup() -> None:
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=3, feature_names=["f"], pooling="mean")]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1]), torch.tensor([1]), weights=torch.tensor([0.5]))
    with pytest.raises(ValueError, match="pool by mean"):
        ebc(kjt)


def test_keyed_tensor_checks_its_columns() -> None:
    with pytest.raises(ValueError, match=r"\[batch, 5\]"):
        KeyedTensor(["a", "b"], [2, 3], torch.zeros(4, 4))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_pack_and_unpack_round_trip(weighted: bool, ids_dtype: torch.dtype) -> None:
    weights = torch.tensor([0.5, 1.25, 3.0, 1e-3, 7.0], dtype=torch.float32) if weighted else None
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.tensor([1, 2, 7, 8, 9], dtype=ids_dtype), torch.tensor([2, 0, 1, 2]), weights=weights
    )
    packed = kjt.pack()
    assert packed.dtype == torch.int64 and packed.dim() == 1
    back = KeyedJaggedTensor.unpack(kjt.keys(), packed)
    assert back.keys() == kjt.keys() and back.stride() == 2
    assert torch.equal(back.values(), kjt.values()) and back.values().dtype == ids_dtype
    assert torch.equal(back.lengths(), kjt.lengths())
    if weighted:
        assert torch.equal(back.weights(), kjt.weights()) and back.weights().dtype == torch.float32
    else:
        assert back.weights_or_none() is None
    with pytest.raises(ValueError, match="pack"):
        KeyedJaggedTensor.unpack(kjt.keys(), packed[:-1])
    assert kjt.to("cpu") is kjt
