"""Port of pytorch/pytorch test/distributed/_shard/sharding_spec/test_sharding_spec.py (torch 2.13).

The sharding API through ``suite_target``. ``TestShardingSpec`` only builds
and parses specs, so it keeps upstream's ``cuda`` placements (parsing a CUDA
device needs no GPU) and runs without upstream's "2 GPUs needed" skip;
``TestCustomShardingSpec`` places shards on ``rank:R/cpu`` over gloo.
"""

import copy
from dataclasses import dataclass
from typing import Union

import torch
from suite_common import _chunk_sharding_specs_list_for_test
from suite_harness import ShardedTensorTestBase, with_comms
from suite_target import load
from torch.testing._internal.common_utils import TestCase

_shard_tensor, sharded_tensor = load("", "_shard_tensor", "sharded_tensor")
ShardedTensor, ShardedTensorMetadata, TensorProperties = load(
    "sharded_tensor", "ShardedTensor", "ShardedTensorMetadata", "TensorProperties"
)
(
    _infer_sharding_spec_from_shards_metadata,
    ChunkShardingSpec,
    DevicePlacementSpec,
    EnumerableShardingSpec,
    ShardingSpec,
    ShardMetadata,
) = load(
    "sharding_spec",
    "_infer_sharding_spec_from_shards_metadata",
    "ChunkShardingSpec",
    "DevicePlacementSpec",
    "EnumerableShardingSpec",
    "ShardingSpec",
    "ShardMetadata",
)
(
    check_tensor,
    get_chunk_sharding_params,
    get_chunked_dim_size,
    get_split_size,
    validate_non_overlapping_shards_metadata,
) = load(
    "sharding_spec._internals",
    "check_tensor",
    "get_chunk_sharding_params",
    "get_chunked_dim_size",
    "get_split_size",
    "validate_non_overlapping_shards_metadata",
)


class TestShardingSpec(TestCase):
    def setUp(self):
        super().setUp()
        # upstream picks "cuda" (or "xpu") and skips without 2 devices; the
        # specs below are only parsed, so "cuda" runs anywhere.
        self.device_type = "cuda"

    def test_device_placement(self):
        # valid devices
        DevicePlacementSpec(f"{self.device_type}:0")
        # port: upstream's torch.device(0) is accelerator 0 (cuda:0 on its
        # machines) and raises on a CPU-only torch; spelled out here.
        DevicePlacementSpec(torch.device("cuda", 0))
        DevicePlacementSpec(torch.device(f"{self.device_type}:0"))
        DevicePlacementSpec(f"rank:0/{self.device_type}:0")
        DevicePlacementSpec("rank:0/cpu")
        DevicePlacementSpec("rank:0")

        # invalid devices
        with self.assertRaisesRegex(ValueError, "Could not parse remote_device"):
            DevicePlacementSpec(f"{self.device_type}:foo")
        with self.assertRaisesRegex(ValueError, "Could not parse remote_device"):
            DevicePlacementSpec("foo:0")
        with self.assertRaisesRegex(RuntimeError, "Invalid device string"):
            DevicePlacementSpec(f"rank:0/{self.device_type}:foo")
        with self.assertRaisesRegex(RuntimeError, "Invalid device string"):
            DevicePlacementSpec("rank:0/cpu2")

    def test_chunked_sharding_spec(self):
        # Test valid specs.
        # port: torch.device(0)/(1) spelled out as in test_device_placement
        ChunkShardingSpec(0, [torch.device("cuda", 0), torch.device("cuda", 1)])
        ChunkShardingSpec(0, [torch.device(f"{self.device_type}:0"), torch.device(f"{self.device_type}:1")])
        ChunkShardingSpec(-1, [f"{self.device_type}:0", f"{self.device_type}:1"])
        ChunkShardingSpec(0, [f"rank:0/{self.device_type}:0", f"rank:0/{self.device_type}:1"])
        ChunkShardingSpec(0, ["rank:0", "rank:1"])
        ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])

        # Test unimplemented error
        with self.assertRaisesRegex(NotImplementedError, "not support named dimension"):
            # Named dimension.
            ChunkShardingSpec("N", [f"{self.device_type}:0", f"{self.device_type}:1"])

        # Test invalid specs
        with self.assertRaisesRegex(ValueError, "needs to be an integer"):
            ChunkShardingSpec(None, [f"{self.device_type}:0", f"{self.device_type}:1"])
        with self.assertRaisesRegex(ValueError, "needs to be an integer"):
            ChunkShardingSpec({}, [f"{self.device_type}:0", f"{self.device_type}:1"])
        with self.assertRaisesRegex(ValueError, "Could not parse remote_device"):
            ChunkShardingSpec(0, ["random:0", f"{self.device_type}:1"])
        with self.assertRaisesRegex(ValueError, "Could not parse remote_device"):
            ChunkShardingSpec(0, [f"{self.device_type}:foo", f"{self.device_type}:1"])
        with self.assertRaisesRegex(ValueError, "Could not parse remote_device"):
            ChunkShardingSpec(0, ["rank:foo", f"{self.device_type}:1"])
        with self.assertRaisesRegex(RuntimeError, "Expected one of"):
            ChunkShardingSpec(0, ["rank:0/foo", f"{self.device_type}:1"])
        with self.assertRaisesRegex(RuntimeError, "Expected one of"):
            ChunkShardingSpec(0, ["rank:0/random:0", f"{self.device_type}:1"])
        with self.assertRaisesRegex(RuntimeError, "Invalid device string"):
            ChunkShardingSpec(0, [f"rank:0/{self.device_type}:foo", f"{self.device_type}:1"])

    def test_enumerable_sharding_spec(self):
        # test valid specs

        # test row-wise sharding
        spec = EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 5], placement=f"{self.device_type}:0"),
                ShardMetadata(shard_offsets=[5, 0], shard_sizes=[5, 5], placement=f"{self.device_type}:1"),
            ]
        )
        check_tensor(spec.shards, torch.rand(10, 5).size())

        # test row and column sharding
        spec = EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[3, 3], placement=f"{self.device_type}:0"),
                ShardMetadata(shard_offsets=[0, 3], shard_sizes=[3, 3], placement=f"{self.device_type}:1"),
                ShardMetadata(shard_offsets=[3, 0], shard_sizes=[3, 3], placement=f"{self.device_type}:2"),
                ShardMetadata(shard_offsets=[3, 3], shard_sizes=[3, 3], placement=f"{self.device_type}:3"),
            ]
        )
        check_tensor(spec.shards, torch.rand(6, 6).size())

        # test uneven shard sizes.
        spec = EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[2, 4], placement=f"{self.device_type}:0"),
                ShardMetadata(shard_offsets=[0, 4], shard_sizes=[4, 2], placement=f"{self.device_type}:1"),
                ShardMetadata(shard_offsets=[2, 0], shard_sizes=[4, 4], placement=f"{self.device_type}:2"),
                ShardMetadata(shard_offsets=[4, 4], shard_sizes=[2, 2], placement=f"{self.device_type}:3"),
            ]
        )
        check_tensor(spec.shards, torch.rand(6, 6).size())

        # test invalid sharding
        with self.assertRaisesRegex(ValueError, "Could not parse remote_device"):
            ShardMetadata(shard_offsets=[0], shard_sizes=[1], placement=f"{self.device_type}:foo")

        with self.assertRaisesRegex(ValueError, "same number of elements"):
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[1], placement=f"{self.device_type}:0")

        with self.assertRaisesRegex(ValueError, "shard_offsets should be >=0"):
            ShardMetadata(shard_offsets=[-1, 0], shard_sizes=[1, 1], placement=f"{self.device_type}:0")

        with self.assertRaisesRegex(ValueError, "shard_sizes should be >= 0"):
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[-1, 1], placement=f"{self.device_type}:0")

        with self.assertRaisesRegex(ValueError, "Empty shard list provided"):
            EnumerableShardingSpec([])

        with self.assertRaisesRegex(ValueError, "Found inconsistent ranks for shards"):
            EnumerableShardingSpec(
                [
                    ShardMetadata(shard_offsets=[0, 0], shard_sizes=[1, 1], placement="cpu"),
                    ShardMetadata(shard_offsets=[0, 0, 0], shard_sizes=[1, 1, 1], placement="cpu"),
                ]
            )

        with self.assertRaisesRegex(ValueError, "Shards.*overlap"):
            EnumerableShardingSpec(
                [
                    ShardMetadata(shard_offsets=[0, 0], shard_sizes=[3, 3], placement="cpu"),
                    ShardMetadata(shard_offsets=[2, 0], shard_sizes=[3, 3], placement="cpu"),
                ]
            )

        spec = EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 5], placement=f"{self.device_type}:0"),
                ShardMetadata(shard_offsets=[5, 0], shard_sizes=[5, 5], placement=f"{self.device_type}:1"),
            ]
        )

        with self.assertRaisesRegex(ValueError, "Rank of tensor is.*but shards rank"):
            check_tensor(spec.shards, torch.rand(10, 10, 10).size())

        spec = EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 5], placement=f"{self.device_type}:0"),
                ShardMetadata(shard_offsets=[5, 0], shard_sizes=[5, 5], placement=f"{self.device_type}:1"),
            ]
        )

        with self.assertRaisesRegex(ValueError, "exceeds tensor dim"):
            check_tensor(spec.shards, torch.rand(10, 3).size())

        spec = EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 5], placement=f"{self.device_type}:0"),
                ShardMetadata(shard_offsets=[5, 5], shard_sizes=[5, 5], placement=f"{self.device_type}:1"),
            ]
        )

        with self.assertRaisesRegex(ValueError, "does not match tensor volume"):
            check_tensor(spec.shards, torch.rand(10, 10).size())

    def test_get_split_size(self):
        self.assertEqual(3, get_split_size(11, 4))
        self.assertEqual(3, get_split_size(12, 4))
        self.assertEqual(4, get_split_size(13, 4))
        self.assertEqual(2, get_split_size(5, 4))

        self.assertEqual(11, get_split_size(11, 1))
        self.assertEqual(1, get_split_size(11, 11))

    def test_get_chunked_dim_size(self):
        self.assertEqual(3, get_chunked_dim_size(11, 3, 0))
        self.assertEqual(2, get_chunked_dim_size(11, 3, 3))
        self.assertEqual(4, get_chunked_dim_size(13, 4, 0))
        self.assertEqual(1, get_chunked_dim_size(13, 4, 3))
        self.assertEqual(0, get_chunked_dim_size(5, 2, 3))

    def test_get_chunk_sharding_params(self):
        ranks = [
            f"rank:0/{self.device_type}:0",
            f"rank:1/{self.device_type}:1",
            f"rank:2/{self.device_type}:2",
            f"rank:3/{self.device_type}:3",
        ]
        spec = ChunkShardingSpec(
            dim=0,
            placements=ranks,
        )
        result = get_chunk_sharding_params(21, 4, spec, 1)
        self.assertEqual(6, result[0])
        self.assertEqual(6, result[1])
        result = get_chunk_sharding_params(21, 4, spec, 3)
        self.assertEqual(18, result[0])
        self.assertEqual(3, result[1])
        ranks[1], ranks[2] = ranks[2], ranks[1]
        ranks[0], ranks[3] = ranks[3], ranks[0]
        spec.placements = ranks
        result = get_chunk_sharding_params(21, 4, spec, 1)
        self.assertEqual(12, result[0])
        self.assertEqual(6, result[1])
        result = get_chunk_sharding_params(21, 4, spec, 3)
        self.assertEqual(0, result[0])
        self.assertEqual(6, result[1])

    def _infer_enum_sharding_spec_case(self):
        shards_metadata = [
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 5], placement=f"{self.device_type}:0"),
            ShardMetadata(shard_offsets=[5, 0], shard_sizes=[10, 5], placement=f"{self.device_type}:1"),
        ]
        spec = _infer_sharding_spec_from_shards_metadata(shards_metadata)
        self.assertTrue(isinstance(spec, EnumerableShardingSpec))
        self.assertEqual(spec.shards, shards_metadata)

        shards_metadata = [
            ShardMetadata(shard_offsets=[0], shard_sizes=[16], placement=f"{self.device_type}:0"),
            ShardMetadata(shard_offsets=[16], shard_sizes=[9], placement=f"{self.device_type}:0"),
        ]
        spec = _infer_sharding_spec_from_shards_metadata(shards_metadata)
        self.assertTrue(isinstance(spec, EnumerableShardingSpec))
        self.assertEqual(spec.shards, shards_metadata)

        shards_metadata = [
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 5], placement=f"rank:0/{self.device_type}:0"),
            ShardMetadata(shard_offsets=[5, 0], shard_sizes=[5, 5], placement=f"rank:1/{self.device_type}:1"),
            ShardMetadata(shard_offsets=[0, 5], shard_sizes=[5, 5], placement=f"rank:2/{self.device_type}:2"),
            ShardMetadata(shard_offsets=[5, 5], shard_sizes=[5, 5], placement=f"rank:3/{self.device_type}:3"),
        ]
        spec = _infer_sharding_spec_from_shards_metadata(shards_metadata)
        self.assertTrue(isinstance(spec, EnumerableShardingSpec))
        self.assertEqual(spec.shards, shards_metadata)

    def _infer_chunk_sharding_spec_case(self, placements, sharding_dim, st_size):
        world_size = len(placements)
        split_size = get_split_size(st_size[sharding_dim], world_size)
        shards_metadata = [None] * world_size
        for idx, placement in enumerate(placements):
            shard_size = copy.deepcopy(st_size)
            offsets = [0] * len(st_size)
            offsets[sharding_dim] = split_size * idx
            shard_size[sharding_dim] = get_chunked_dim_size(st_size[sharding_dim], split_size, idx)
            shards_metadata[placement.rank()] = ShardMetadata(
                shard_offsets=offsets,
                shard_sizes=shard_size,
                placement=placement,
            )

        spec = _infer_sharding_spec_from_shards_metadata(shards_metadata)
        self.assertTrue(isinstance(spec, ChunkShardingSpec))
        self.assertEqual(spec.dim, sharding_dim)
        self.assertEqual(spec.placements, placements)

    def test_infer_sharding_spec_from_shards_metadata(self):
        self._infer_enum_sharding_spec_case()
        chunk_specs = _chunk_sharding_specs_list_for_test([0, 0, 1, 1], seed=31)
        for spec in chunk_specs:
            self._infer_chunk_sharding_spec_case(spec.placements, 0, [4, 16])
            self._infer_chunk_sharding_spec_case(spec.placements, 0, [5, 15, 16])
            self._infer_chunk_sharding_spec_case(spec.placements, 1, [12, 16])
            self._infer_chunk_sharding_spec_case(spec.placements, 2, [4, 18, 15])
            self._infer_chunk_sharding_spec_case(spec.placements, 3, [7, 12, 16, 37])
            self._infer_chunk_sharding_spec_case(spec.placements, 4, [50, 4, 18, 15, 77])

    def test_check_overlapping(self):
        shards = [
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 5], placement=f"{self.device_type}:0"),
            ShardMetadata(shard_offsets=[5, 0], shard_sizes=[5, 5], placement=f"{self.device_type}:1"),
        ]
        validate_non_overlapping_shards_metadata(shards)

        shards = [
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 5], placement=f"{self.device_type}:0"),
            ShardMetadata(shard_offsets=[4, 0], shard_sizes=[5, 5], placement=f"{self.device_type}:1"),
        ]
        with self.assertRaisesRegex(ValueError, "overlap"):
            validate_non_overlapping_shards_metadata(shards)

        shards = [
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 5], placement=f"{self.device_type}:0"),
            ShardMetadata(shard_offsets=[0, 4], shard_sizes=[5, 5], placement=f"{self.device_type}:1"),
        ]
        with self.assertRaisesRegex(ValueError, "overlap"):
            validate_non_overlapping_shards_metadata(shards)

        shards = [
            ShardMetadata(shard_offsets=[5, 0, 5], shard_sizes=[5, 5, 5], placement=f"{self.device_type}:0"),
            ShardMetadata(shard_offsets=[5, 5, 5], shard_sizes=[5, 5, 5], placement=f"{self.device_type}:1"),
        ]
        validate_non_overlapping_shards_metadata(shards)

        shards = [
            ShardMetadata(shard_offsets=[5, 0, 5], shard_sizes=[5, 5, 5], placement=f"{self.device_type}:0"),
            ShardMetadata(shard_offsets=[5, 4, 5], shard_sizes=[5, 5, 5], placement=f"{self.device_type}:1"),
        ]
        with self.assertRaisesRegex(ValueError, "overlap"):
            validate_non_overlapping_shards_metadata(shards)

        shards = [
            ShardMetadata(shard_offsets=[5, 0, 5], shard_sizes=[5, 5, 5], placement=f"{self.device_type}:0"),
            ShardMetadata(shard_offsets=[5, 4, 9], shard_sizes=[5, 5, 5], placement=f"{self.device_type}:1"),
        ]
        with self.assertRaisesRegex(ValueError, "overlap"):
            validate_non_overlapping_shards_metadata(shards)


# Custom ShardingSpec, an simple example to do grid sharding
@dataclass
class GridShardingSpec(ShardingSpec):
    grid_size: int
    placements: list[Union[torch.distributed._remote_device, str]]

    def __post_init__(self):
        for i, remote_device in enumerate(self.placements):
            if not isinstance(remote_device, torch.distributed._remote_device):
                self.placements[i] = torch.distributed._remote_device(remote_device)

    def build_metadata(
        self,
        tensor_sizes: torch.Size,
        tensor_properties: TensorProperties,
    ) -> ShardedTensorMetadata:
        tensor_num_dim = len(tensor_sizes)
        assert tensor_num_dim == 2, "only support 2-dim tensor for grid sharding"
        shards_metadata = []

        def chunk_num(dim_size, grid_size):
            assert dim_size % grid_size == 0, "only support dim_size mod grid_size == 0"
            return dim_size // grid_size

        row_chunks = chunk_num(tensor_sizes[0], self.grid_size)
        col_chunks = chunk_num(tensor_sizes[1], self.grid_size)

        assert row_chunks * col_chunks == len(self.placements)
        for row_idx in range(row_chunks):
            for col_idx in range(col_chunks):
                shards_metadata.append(
                    ShardMetadata(
                        shard_offsets=[
                            row_idx * self.grid_size,
                            col_idx * self.grid_size,
                        ],
                        shard_sizes=[self.grid_size, self.grid_size],
                        placement=self.placements[row_idx * row_chunks + col_idx],
                    )
                )
        return ShardedTensorMetadata(
            shards_metadata=shards_metadata,
            size=tensor_sizes,
            tensor_properties=tensor_properties,
        )

    def shard(self, tensor: torch.Tensor, src_rank: int = 0, process_group=None) -> ShardedTensor:
        raise NotImplementedError("GridShardingSpec.shard not implemented yet!")


# upstream: the accelerator's device type and its backend (nccl/xccl); the port: cpu over gloo.
DEVICE_TYPE = "cpu"
BACKEND = "gloo"


class TestCustomShardingSpec(ShardedTensorTestBase):
    def test_custom_sharding_spec(self):
        ranks = [
            f"rank:0/{DEVICE_TYPE}",
            f"rank:1/{DEVICE_TYPE}",
            f"rank:2/{DEVICE_TYPE}",
            f"rank:3/{DEVICE_TYPE}",
        ]

        grid_spec = GridShardingSpec(grid_size=4, placements=ranks)

        tensor_properties = TensorProperties(
            dtype=torch.get_default_dtype(),
            layout=torch.strided,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=False,
        )

        meta = grid_spec.build_metadata(torch.Size((8, 8)), tensor_properties)
        check_tensor(meta.shards_metadata, torch.Size((8, 8)))

    @with_comms(init_rpc=False, backend=BACKEND)
    def test_custom_sharding_spec_tensor_ctor(self):
        """Test sharded_tensor.ones(...) with the custom
        grid sharding spec.
        """

        ranks = [
            f"rank:0/{DEVICE_TYPE}",
            f"rank:1/{DEVICE_TYPE}",
            f"rank:2/{DEVICE_TYPE}",
            f"rank:3/{DEVICE_TYPE}",
        ]

        grid_spec = GridShardingSpec(grid_size=2, placements=ranks)

        st = sharded_tensor.ones(grid_spec, 4, 4)

        # Validate local shard is initialized with torch.ones
        local_shards = st.local_shards()
        self.assertEqual(1, len(local_shards))
        local_shard = local_shards[0].tensor
        self.assertEqual(torch.device(DEVICE_TYPE), local_shard.device)
        self.assertEqual((2, 2), local_shard.size())
        self.assertEqual(local_shard, torch.ones(2, 2))

    @with_comms(init_rpc=False, backend=BACKEND)
    def test_custom_sharding_spec_shard_tensor(self):
        """Test custom spec can be invoked from the
        _shard_tensor callsite.
        """

        ranks = [
            f"rank:0/{DEVICE_TYPE}",
            f"rank:1/{DEVICE_TYPE}",
            f"rank:2/{DEVICE_TYPE}",
            f"rank:3/{DEVICE_TYPE}",
        ]

        grid_spec = GridShardingSpec(grid_size=2, placements=ranks)

        with self.assertRaisesRegex(NotImplementedError, "not implemented"):
            _shard_tensor(torch.randn(8, 8), grid_spec)
