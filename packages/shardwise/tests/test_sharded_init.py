"""Random creation and ``torch.nn.init`` on ShardedTensors: same seed, same whole tensor, any layout.

Each rank returns its shards as ``(offsets, tensor)``; the parent assembles
the whole tensor and compares it across world sizes 1, 2, 3 and specs.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise
import shardwise.sharded_tensor as sharded
from shardwise._tensor.ops import random as _random
from shardwise._tensor.ops.random import block_seed, draw_seed, fill_box
from shardwise._vocab.metadata import ShardMetadata
from shardwise.sharded_tensor import ShardedTensor
from shardwise.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardingSpec

from rank_helpers import run as _run

SIZE = (37, 23)
SIZE3 = (6, 5, 7)
Assembled = list[tuple[list[int], torch.Tensor]]



def _placements(ranks: list[int]) -> list[str]:
    return [f"rank:{r}/cpu" for r in ranks]


def _grid(size: tuple[int, ...], w: int) -> EnumerableShardingSpec:
    """An uneven 3 x 2 grid, ranks permuted, some ranks holding two blocks."""
    rows = [0, 5, 20, size[0]]
    cols = [0, 9, size[1]]
    shards = []
    i = 0
    for r0, r1 in zip(rows, rows[1:], strict=False):
        for c0, c1 in zip(cols, cols[1:], strict=False):
            shards.append(ShardMetadata([r0, c0], [r1 - r0, c1 - c0], f"rank:{(2 * i + 1) % w}/cpu"))
            i += 1
    return EnumerableShardingSpec(shards)


def layouts(w: int) -> dict[str, tuple[tuple[int, ...], ShardingSpec]]:
    """Every layout the seed tests compare, for a world of ``w`` ranks."""
    ranks = list(range(w))
    permuted = [(2 + i) % w for i in range(w)]
    return {
        "whole": (SIZE, ChunkShardingSpec(0, ["rank:0/cpu"])),
        "rows": (SIZE, ChunkShardingSpec(0, _placements(ranks))),
        "cols": (SIZE, ChunkShardingSpec(1, _placements(ranks))),
        # more pieces than ranks: uneven, some empty, placements permuted
        "rows_permuted": (SIZE, ChunkShardingSpec(0, _placements(permuted * 3 + [0] * 30))),
        "grid": (SIZE, _grid(SIZE, w)),
        "3d_whole": (SIZE3, ChunkShardingSpec(0, ["rank:0/cpu"])),
        "3d_dim1": (SIZE3, ChunkShardingSpec(1, _placements(permuted))),
        "3d_dim2": (SIZE3, ChunkShardingSpec(-1, _placements(ranks * 2))),
    }


def _empty(size: tuple[int, ...], spec: ShardingSpec) -> ShardedTensor:
    return sharded.empty(spec, *size)


INIT = torch.nn.init
# name -> how to make the tensor from (size, spec)
FILLS: dict[str, Callable[[tuple[int, ...], ShardingSpec], ShardedTensor]] = {
    "rand": lambda size, spec: sharded.rand(spec, *size),
    "randn": lambda size, spec: sharded.randn(spec, *size, dtype=torch.float64),
    "second_rand": lambda size, spec: (sharded.rand(spec, *size), sharded.rand(spec, *size))[1],
    "rand_like": lambda size, spec: torch.rand_like(_empty(size, spec)),
    "randn_like": lambda size, spec: torch.randn_like(_empty(size, spec), dtype=torch.float16),
    "uniform_": lambda size, spec: INIT.uniform_(_empty(size, spec), -2.0, 3.0),
    "normal_": lambda size, spec: INIT.normal_(_empty(size, spec), mean=1.0, std=0.5),
    "kaiming_uniform_": lambda size, spec: INIT.kaiming_uniform_(_empty(size, spec), a=math.sqrt(5)),
    "kaiming_normal_": lambda size, spec: INIT.kaiming_normal_(_empty(size, spec), mode="fan_out"),
    "xavier_uniform_": lambda size, spec: INIT.xavier_uniform_(_empty(size, spec), gain=2.0),
    "xavier_normal_": lambda size, spec: INIT.xavier_normal_(_empty(size, spec)),
    "trunc_normal_": lambda size, spec: INIT.trunc_normal_(_empty(size, spec), std=0.7),
    "trunc_normal_tail": lambda size, spec: INIT.trunc_normal_(_empty(size, spec), mean=0.0, std=1.0, a=1.5, b=3.0),
    "constant_": lambda size, spec: INIT.constant_(_empty(size, spec), 0.25),
    "ones_": lambda size, spec: INIT.ones_(_empty(size, spec)),
    "Tensor.uniform_": lambda size, spec: _empty(size, spec).uniform_(to=4.0),
    "Tensor.normal_": lambda size, spec: _empty(size, spec).normal_(2.0),
}


def _shards(t: ShardedTensor) -> Assembled:
    return [(list(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in t.local_shards()]


def seeded(block_size: int) -> dict[str, Any]:
    """Every fill on every layout from seed 1234; also the generator state after each fill."""
    _random.BLOCK_SIZE = block_size
    w = shardwise.get_default_group().size
    out: dict[str, Any] = {}
    for layout, (size, spec) in layouts(w).items():
        for name, make in FILLS.items():
            torch.manual_seed(1234)
            t = make(size, spec)
            assert isinstance(t, ShardedTensor) and tuple(t.size()) == size
            out[f"{layout}/{name}"] = (_shards(t), torch.rand(2))
        # a generator= argument is honoured: the base seed comes from it, the default generator is untouched
        torch.manual_seed(99)
        g = torch.Generator().manual_seed(7)
        t = INIT.normal_(_empty(size, spec), generator=g)
        out[f"{layout}/generator"] = (_shards(t), torch.rand(2))
    return out


def _assemble(pieces: list[Assembled], size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    full = torch.full(size, float("nan"), dtype=dtype)
    seen = torch.zeros(size, dtype=torch.int32)
    for rank_pieces in pieces:
        for offsets, tensor in rank_pieces:
            box = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape, strict=True))
            full[box] = tensor
            seen[box] += 1
    assert bool((seen == 1).all()), "shards must cover the tensor exactly once"
    return full


@pytest.mark.parametrize("block_size", [64, _random.BLOCK_SIZE])
def test_same_seed_same_tensor_across_world_sizes_and_specs(block_size: int) -> None:
    # Small blocks make every layout cross many block boundaries (rows, columns, 3-D boxes).
    results = {w: _run(seeded, w, block_size) for w in ((1, 2, 3) if block_size == 64 else (2,))}
    reference: dict[tuple[tuple[int, ...], str], tuple[torch.Tensor, torch.Tensor]] = {}
    for w, per_rank in results.items():
        for layout, (size, _) in layouts(w).items():
            for name in [*FILLS, "generator"]:
                key = f"{layout}/{name}"
                pieces = [per_rank[r][key][0] for r in range(w)]
                dtype = next(t.dtype for rank_pieces in pieces for _, t in rank_pieces)
                full = _assemble(pieces, size, dtype)
                after = {tuple(per_rank[r][key][1].tolist()) for r in range(w)}
                assert len(after) == 1, f"{key}: ranks' default generators fell out of step"
                ref = reference.setdefault((size, name), (full, per_rank[0][key][1]))
                assert torch.equal(full, ref[0]), f"{key} on {w} ranks differs from the first layout"
                assert torch.equal(per_rank[0][key][1], ref[1]), f"{key}: generator state differs"
    fulls = {name: reference[(SIZE, name)][0] for name in FILLS}
    # generator= did not touch the default generator: the draw after it is torch.manual_seed(99)'s first
    torch.manual_seed(99)
    assert torch.equal(reference[(SIZE, "generator")][1], torch.rand(2))
    # one base seed per call: a second fill differs from the first; fills from one seed are related as torch's are
    assert not torch.equal(fulls["rand"], fulls["second_rand"])
    assert torch.allclose(fulls["rand"] * 4, fulls["Tensor.uniform_"])
    assert torch.equal(fulls["constant_"], torch.full(SIZE, 0.25)) and torch.equal(fulls["ones_"], torch.ones(SIZE))
    assert fulls["randn"].dtype == torch.float64 and fulls["randn_like"].dtype == torch.float16


def statistics() -> dict[str, Any]:
    """Distribution checks on a large tensor cut in uneven pieces (one rank)."""
    size = (400, 500)
    fan_in, fan_out = 500, 400
    spec = ChunkShardingSpec(1, _placements([0] * 7))
    torch.manual_seed(5)
    out: dict[str, Any] = {}

    def whole(t: ShardedTensor) -> torch.Tensor:
        return _assemble([_shards(t)], size, t.dtype).double()

    for name, make in {
        "rand": lambda: sharded.rand(spec, *size),
        "randn": lambda: sharded.randn(spec, *size),
        "uniform": lambda: INIT.uniform_(_empty(size, spec), a=-3.0, b=5.0),
        "normal": lambda: INIT.normal_(_empty(size, spec), mean=2.0, std=3.0),
        "trunc": lambda: INIT.trunc_normal_(_empty(size, spec)),
        "trunc_tail": lambda: INIT.trunc_normal_(_empty(size, spec), a=2.0, b=3.0),
        "kaiming_uniform": lambda: INIT.kaiming_uniform_(_empty(size, spec), nonlinearity="relu"),
        "kaiming_normal": lambda: INIT.kaiming_normal_(_empty(size, spec), nonlinearity="relu"),
        "xavier_uniform": lambda: INIT.xavier_uniform_(_empty(size, spec)),
        "xavier_normal": lambda: INIT.xavier_normal_(_empty(size, spec)),
    }.items():
        v = whole(make())
        out[name] = (v.mean().item(), v.std().item(), v.min().item(), v.max().item())
    out["fans"] = (fan_in, fan_out)
    return out


def _truncated(a: float, b: float) -> tuple[float, float]:
    """Mean and std of a standard normal truncated to [a, b]."""
    pdf = [math.exp(-x * x / 2) / math.sqrt(2 * math.pi) for x in (a, b)]
    mass = (math.erf(b / math.sqrt(2)) - math.erf(a / math.sqrt(2))) / 2
    mean = (pdf[0] - pdf[1]) / mass
    var = 1 + (a * pdf[0] - b * pdf[1]) / mass - mean * mean
    return mean, math.sqrt(var)


def test_distributions() -> None:
    (stats,) = _run(statistics, 1)
    fan_in, fan_out = stats["fans"]

    def close(name: str, mean: float, std: float, lo: float, hi: float, tol: float = 0.02) -> None:
        m, s, mn, mx = stats[name]
        assert abs(m - mean) <= tol * max(1.0, std) and abs(s - std) <= tol * std, (name, stats[name], mean, std)
        assert lo <= mn and mx <= hi, (name, stats[name], lo, hi)

    close("rand", 0.5, math.sqrt(1 / 12), 0.0, 1.0)
    assert stats["rand"][3] < 1.0
    close("randn", 0.0, 1.0, -7, 7)
    close("uniform", 1.0, 8 / math.sqrt(12), -3.0, 5.0)
    close("normal", 2.0, 3.0, -30, 30)
    close("trunc", *_truncated(-2.0, 2.0), -2.0, 2.0)
    close("trunc_tail", *_truncated(2.0, 3.0), 2.0, 3.0)
    bound = math.sqrt(6 / fan_in)  # fan from the global size, not a shard's
    close("kaiming_uniform", 0.0, bound / math.sqrt(3), -bound, bound)
    assert stats["kaiming_uniform"][3] > 0.99 * bound
    close("kaiming_normal", 0.0, math.sqrt(2 / fan_in), -1, 1)
    bound = math.sqrt(6 / (fan_in + fan_out))
    close("xavier_uniform", 0.0, bound / math.sqrt(3), -bound, bound)
    close("xavier_normal", 0.0, math.sqrt(2 / (fan_in + fan_out)), -1, 1)


def _sample(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.empty(n, dtype=torch.float64).uniform_(generator=g)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_fill_box_matches_the_whole_fill(data: st.DataObject) -> None:
    size = data.draw(st.lists(st.integers(0, 6), min_size=0, max_size=4))
    offsets = [data.draw(st.integers(0, s)) for s in size]
    sizes = [data.draw(st.integers(0, s - o)) for s, o in zip(size, offsets, strict=True)]
    block = data.draw(st.integers(1, 40))
    whole = torch.empty(size, dtype=torch.float64)
    fill_box(whole, [0] * len(size), size, 11, _sample, block)
    box = torch.empty(sizes, dtype=torch.float64)
    if len(sizes) >= 2 and data.draw(st.booleans()):
        box = torch.empty(sizes[::-1], dtype=torch.float64).permute(*reversed(range(len(sizes))))
    fill_box(box, offsets, size, 11, _sample, block)
    expected = whole[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]
    assert torch.equal(box, expected)


def test_fill_box_block_layout() -> None:
    size, block = [7, 5, 3], 11
    whole = torch.empty(size, dtype=torch.float64)
    fill_box(whole, [0, 0, 0], size, 3, _sample, block)
    n = math.prod(size)
    expected = []
    for b in range(math.ceil(n / block)):
        g = torch.Generator()
        g.manual_seed(block_seed(3, b))
        expected.append(_sample(min(block, n - b * block), g))
    assert torch.equal(whole.flatten(), torch.cat(expected))
    # a different base seed gives different blocks; seeds are well spread
    assert len({block_seed(3, b) for b in range(1000)} | {block_seed(4, b) for b in range(1000)}) == 2000


def test_draw_seed_consumes_one_draw() -> None:
    torch.manual_seed(0)
    first = draw_seed()
    after = torch.rand(3)
    torch.manual_seed(0)
    torch.randint(0, 2**63 - 1, (1,))
    assert torch.equal(after, torch.rand(3))
    torch.manual_seed(0)
    assert draw_seed() == first
    g = torch.Generator().manual_seed(1)
    assert draw_seed(g) == draw_seed(torch.Generator().manual_seed(1))
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        draw_seed(5)  # type: ignore[arg-type]


def cuda_fills() -> list[bool]:
    """The same seed gives the same values on CUDA shards as on CPU shards."""
    spec = ChunkShardingSpec(1, ["rank:0/cpu", "rank:0/cpu"])
    cuda_spec = ChunkShardingSpec(1, ["rank:0/cuda", "rank:0/cuda"])
    checks = []
    for make in (sharded.rand, sharded.randn):
        torch.manual_seed(3)
        on_cpu = make(spec, 40, 30)
        torch.manual_seed(3)
        on_cuda = make(cuda_spec, 40, 30)
        for a, b in zip(on_cpu.local_shards(), on_cuda.local_shards(), strict=True):
            checks.append(b.tensor.device.type == "cuda" and torch.equal(a.tensor, b.tensor.cpu()))
    return checks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_shards_get_the_same_values() -> None:
    (checks,) = _run(cuda_fills, 1)
    assert checks and all(checks)
