"""Port of pytorch/pytorch test/distributed/_shard/sharded_tensor/test_sharded_tensor.py (torch 2.13).

CPU/gloo instead of CUDA/NCCL: placements ``rank:R/cpu`` for ``rank:R/cuda:R``,
``cpu`` for ``cuda:R``; the sharding API through ``suite_target``. Tests that
need RPC, CUDA or pinned memory are listed in ``OUT_OF_SCOPE`` (and SCOPE.md).
"""

import copy
import io
import itertools
import math
import pickle

import torch
import torch.distributed as dist
from suite_common import DEVICE, _chunk_sharding_specs_list_for_test
from suite_harness import ShardedTensorTestBase, differs_on_shardwise, out_of_scope, torch_pg_only, with_comms
from suite_target import load
from torch.distributed.remote_device import _remote_device
from torch.testing._internal.common_distributed import spawn_threads_and_init_comms
from torch.testing._internal.common_utils import TestCase

sharded_tensor = load("sharded_tensor")
_collect_local_shard, _reshard_output, _shard_tensor, load_with_process_group, shard_parameter = load(
    "api", "_collect_local_shard", "_reshard_output", "_shard_tensor", "load_with_process_group", "shard_parameter"
)
(
    custom_sharded_op_impl,
    pre_load_state_dict_hook,
    Shard,
    ShardedTensor,
    ShardedTensorBase,
    ShardedTensorMetadata,
    state_dict_hook,
) = load(
    "sharded_tensor",
    "custom_sharded_op_impl",
    "pre_load_state_dict_hook",
    "Shard",
    "ShardedTensor",
    "ShardedTensorBase",
    "ShardedTensorMetadata",
    "state_dict_hook",
)
_create_tensor_from_params, TensorProperties = load(
    "sharded_tensor.api", "_create_tensor_from_params", "TensorProperties"
)
_parse_and_validate_remote_device = load("sharded_tensor.utils", "_parse_and_validate_remote_device")
ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata = load(
    "sharding_spec", "ChunkShardingSpec", "EnumerableShardingSpec", "ShardMetadata"
)

ROWS = ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu", "rank:3/cpu"]

_RPC = "RPC: "
_PINNED = "pinned memory needs an accelerator; CPU-only torch raises"
OUT_OF_SCOPE = {
    "TestShardedTensorChunked.test_sharded_tensor_metadata": _RPC + "tensors built with init_rrefs=True; "
    + _PINNED,
    "TestShardedTensorChunked.test_complete_world_size": _RPC + "init_rrefs=True and remote_shards()",
    "TestShardedTensorChunked.test_partial_world_size": _RPC + "init_rrefs=True and remote_shards()",
    "TestShardedTensorChunked.test_new_group": _RPC + "init_rrefs=True and remote_shards()",
    "TestShardedTensorChunked.test_multiple_local_shards": _RPC + "init_rrefs=True and remote_shards()",
    "TestShardedTensorChunked.test_invalid_pg_rpc_ranks": _RPC + "init_rpc() with shifted ranks",
    "TestShardedTensorChunked.test_sharded_tensor_sizes": _RPC + "every tensor is built with init_rrefs=True",
    "TestShardedTensorChunked.test_state_dict": _RPC + "MyShardedModel1 builds its tensors with init_rrefs=True",
    "TestShardedTensorChunked.test_state_dict_new_group": _RPC
    + "MyShardedModel1 builds its tensors with init_rrefs=True",
    "TestShardedTensorChunked.test_load_state_dict_errors": _RPC + "init_rpc(), rpc.shutdown(), init_rrefs=True",
    "TestShardedTensorChunked.test_cleanup": _RPC + "init_rrefs=True; and torch's private "
    "sharded_tensor.api._sharded_tensor_map",
    "TestShardedTensorEnumerable.test_sharded_tensor_metadata": _RPC + "tensors built with init_rrefs=True; "
    + _PINNED,
    "TestShardedTensorEnumerable.test_grid_sharding": _RPC + "init_rrefs=True and remote_shards()",
    "TestShardedTensorEnumerable.test_create_sharded_tensor_with_ones": _RPC + "built with init_rrefs=True",
    "TestShardedTensorEnumerable.test_gather_even": _RPC + "built with init_rrefs=True",
    "TestShardedTensorEnumerable.test_gather_uneven": _RPC + "built with init_rrefs=True",
    "TestShardedTensorEnumerable.test_sharded_tensor_to_cpu": "CUDA-only: moves CUDA shards to the CPU "
    "(on CPU shards .cpu() returns the same tensor, which the test asserts it does not)",
    "TestShardedTensorEnumerable.test_sharded_tensor_to_cuda": "CUDA-only: moves shards to CUDA",
    "TestShardedTensorEnumerable.test_sharded_tensor_to_test": "CUDA-only: .to('cuda'), .to(rank), CUDA tensors",
    "TestShardedTensorEnumerable.test_sharded_tensor_device": "CUDA-only: torch.cuda.current_device()",
    "TestShardedTensorEnumerable.test_partial_world_size": _RPC + "init_rrefs=True and remote_shards()",
    "TestShardedTensorEnumerable.test_new_group": _RPC + "init_rrefs=True and remote_shards()",
    "TestShardedTensorEnumerable.test_multiple_local_shards": _RPC + "init_rrefs=True and remote_shards()",
    "TestShardedTensorEnumerable.test_with_rpc_names": _RPC + "worker-name placements, remote_shards()",
    "TestShardedTensorFromLocalTensor.test_init_from_local_tensor": _RPC + "init_rrefs=True and remote_shards()",
    "TestShardedTensorFromLocalShards.test_init_from_local_shards": _RPC + "init_rrefs=True and remote_shards()",
    "TestShardedTensorFromLocalShards.test_init_from_local_shards_and_global_metadata": _RPC
    + "init_rrefs=True and remote_shards()",
    "TestShardedTensorFromLocalShards.test_init_from_local_shards_invalid_pin_memory": _PINNED,
}


class TestShardedTensorMetadata(TestCase):
    def test_serialize_and_deserialize(self):
        shard_metadatas = [
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 5], placement="rank:0/cpu"),
            ShardMetadata(shard_offsets=[0, 5], shard_sizes=[5, 5], placement="rank:1/cpu"),
            ShardMetadata(shard_offsets=[5, 0], shard_sizes=[5, 5], placement="rank:2/cpu"),
            ShardMetadata(shard_offsets=[5, 5], shard_sizes=[5, 5], placement="rank:3/cpu"),
        ]

        dtypes = [
            torch.float,
            torch.double,
            torch.cfloat,
            torch.cdouble,
            torch.half,
            torch.bfloat16,
            torch.uint8,
            torch.int8,
            torch.short,
            torch.int,
            torch.long,
            torch.bool,
        ]

        layouts = [torch.strided, torch.sparse_coo]
        requires_grads = [True, False]
        memory_formats = [
            torch.contiguous_format,
            torch.channels_last,
            torch.preserve_format,
        ]
        pin_memories = [True, False]

        for tensor_properties_input in itertools.product(dtypes, layouts, requires_grads, memory_formats, pin_memories):
            (
                dtype,
                layout,
                requires_grad,
                memory_format,
                pin_memory,
            ) = tensor_properties_input

            expected_st_metadata = sharded_tensor.ShardedTensorMetadata(
                shard_metadatas,
                (10, 10),
                TensorProperties(dtype, layout, requires_grad, memory_format, pin_memory),
            )

            pickled_obj = pickle.dumps(expected_st_metadata)
            st_metadata = pickle.loads(pickled_obj)
            self.assertEqual(expected_st_metadata, st_metadata)


class TestCreateTensorFromParams(TestCase):
    def test_empty(self):
        expected_dtype = torch.double
        tensor_properties = TensorProperties(
            dtype=expected_dtype,
            layout=torch.strided,
            requires_grad=False,
            pin_memory=False,
            memory_format=torch.contiguous_format,
        )
        local_device = torch.device("cpu")
        local_tensor = _create_tensor_from_params(5, 10, local_device=local_device, tensor_properties=tensor_properties)
        self.assertEqual(local_device, local_tensor.device)
        self.assertEqual(expected_dtype, local_tensor.dtype)
        self.assertEqual(torch.strided, local_tensor.layout)
        self.assertEqual(False, local_tensor.requires_grad)


class TestShardParameter(ShardedTensorTestBase):
    @with_comms(init_rpc=False)
    def test_shard_parameter(self):
        spec = ChunkShardingSpec(dim=0, placements=list(ROWS))

        fc = torch.nn.Linear(12, 12).cpu()
        weight_og = fc.weight.clone()
        shard_parameter(fc, "weight", spec)

        # Verify.
        self.assertTrue(isinstance(fc.weight, ShardedTensor))
        local_shards = fc.weight.local_shards()
        self.assertEqual(1, len(local_shards))
        self.assertEqual(torch.Size([3, 12]), local_shards[0].tensor.size())
        self.assertEqual(3, local_shards[0].tensor.size(0))
        self.assertEqual(12, local_shards[0].tensor.size(1))
        self.assertEqual(torch.narrow(weight_og, 0, 3 * self.rank, 3), local_shards[0].tensor)

    @differs_on_shardwise("shard-any-spec")
    @with_comms(init_rpc=False)
    def test_shard_parameter_errors(self):
        spec = ChunkShardingSpec(dim=0, placements=list(ROWS))

        fc = torch.nn.Linear(12, 12).cpu()
        with self.assertRaisesRegex(ValueError, "does not match with src_rank"):
            shard_parameter(fc, "weight", spec, src_rank=self.rank)

        with self.assertRaisesRegex(AttributeError, "has no attribute"):
            shard_parameter(fc, "foo", spec)

        with self.assertRaisesRegex(ValueError, "Expected Linear.bias to be a Tensor, but found str"):
            del fc.bias
            fc.bias = "foo"
            shard_parameter(fc, "bias", spec)

        with self.assertRaisesRegex(ValueError, "not a contiguous Tensor"):
            fc.bias = torch.rand(10, 10).t()
            shard_parameter(fc, "bias", spec)

        spec = ChunkShardingSpec(
            dim=0,
            placements=[
                f"rank:{self.rank}/cpu",
                "rank:1/cpu",
                "rank:2/cpu",
                "rank:3/cpu",
            ],
        )
        with self.assertRaisesRegex(ValueError, "does not match with sharding_spec"):
            shard_parameter(fc, "weight", spec)

        spec = EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 5], placement="rank:0/cpu"),
                ShardMetadata(shard_offsets=[5, 0], shard_sizes=[5, 5], placement="rank:1/cpu"),
            ]
        )
        with self.assertRaisesRegex(NotImplementedError, "not implemented yet!"):
            shard_parameter(fc, "weight", spec)


class TestShardTensor(ShardedTensorTestBase):
    @with_comms(init_rpc=False)
    def test_shard_tensor(self):
        spec = ChunkShardingSpec(dim=0, placements=list(ROWS))
        tensor = torch.rand(12, 12)
        st = _shard_tensor(tensor, spec)

        # Verify.
        self.assertTrue(isinstance(st, sharded_tensor.ShardedTensor))
        local_shard = st.local_tensor()
        self.assertEqual(1, len(st.local_shards()))
        self.assertEqual(torch.Size([3, 12]), local_shard.size())
        self.assertEqual(torch.narrow(tensor, 0, 3 * self.rank, 3), local_shard)

    @torch_pg_only("dist.get_rank()")
    @with_comms(init_rpc=False)
    def test_shard_tensor_with_empty_shard(self):
        spec = ChunkShardingSpec(dim=0, placements=list(ROWS))
        tensor = torch.rand(9, 12)
        st = _shard_tensor(tensor, spec)

        # Verify.
        self.assertTrue(isinstance(st, sharded_tensor.ShardedTensor))
        sms = st.metadata().shards_metadata
        self.assertEqual(len(sms), 4)
        for sm in sms:
            self.assertTrue(sm.shard_offsets[0] + sm.shard_sizes[0] <= tensor.size(0))

        local_shard = st.local_tensor()
        self.assertEqual(1, len(st.local_shards()))
        if dist.get_rank() < 3:
            self.assertEqual(torch.Size([3, 12]), local_shard.size())
            self.assertEqual(torch.narrow(tensor, 0, 3 * self.rank, 3), local_shard)
        else:
            self.assertEqual(torch.Size([0, 12]), local_shard.size())

    @differs_on_shardwise("shard-any-spec")
    @with_comms(init_rpc=False)
    def test_shard_tensor_errors(self):
        spec = ChunkShardingSpec(dim=0, placements=list(ROWS))
        tensor = torch.rand(12, 12)

        with self.assertRaisesRegex(ValueError, "does not match with src_rank"):
            _shard_tensor(tensor, spec, src_rank=self.rank)

        with self.assertRaisesRegex(ValueError, "not a contiguous Tensor"):
            tensor_t = torch.rand(12, 12).t()
            _shard_tensor(tensor_t, spec)

        spec = ChunkShardingSpec(
            dim=0,
            placements=[
                f"rank:{self.rank}/cpu",
                "rank:1/cpu",
                "rank:2/cpu",
                "rank:3/cpu",
            ],
        )
        with self.assertRaisesRegex(ValueError, "does not match with sharding_spec"):
            _shard_tensor(tensor, spec)

        spec = EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 5], placement="rank:0/cpu"),
                ShardMetadata(shard_offsets=[5, 0], shard_sizes=[5, 5], placement="rank:1/cpu"),
            ]
        )
        with self.assertRaisesRegex(NotImplementedError, "not implemented yet!"):
            _shard_tensor(tensor, spec)


class TestModuleHookApi(ShardedTensorTestBase):
    class DummyNNModule(torch.nn.Module):
        def __init__(self, spec, tensor_size):
            super().__init__()
            self.st = sharded_tensor.rand(spec, *tensor_size)

        def forward(self):
            return self.st

    @torch_pg_only("dist.distributed_c10d._get_default_group()")
    @with_comms(init_rpc=False)
    def test_reshard_output(self):
        specs = _chunk_sharding_specs_list_for_test([0, 1], seed=5)
        spec, reshard_spec = specs[0], specs[1]
        test_module = self.DummyNNModule(spec, [24, 12])
        st = test_module()
        local_shard = st.local_tensor()
        pg = dist.distributed_c10d._get_default_group()
        st_compare = ShardedTensor._init_from_local_shards(
            copy.deepcopy(st.local_shards()),
            st.size(),
            process_group=pg,
        )
        st_compare._sharding_spec = copy.deepcopy(spec)
        st_compare.reshard(reshard_spec)
        test_module = _reshard_output(test_module, reshard_spec)
        st = test_module()
        local_shard = st.local_tensor()
        local_shard_compare = st_compare.local_tensor()
        self.assertEqual(local_shard, local_shard_compare)
        self.assertEqual(local_shard.size(0), 24)
        self.assertEqual(local_shard.size(1), 3)

    @with_comms(init_rpc=False)
    def test_collect_local_shard(self):
        specs = _chunk_sharding_specs_list_for_test([0], seed=5)
        spec = specs[0]
        test_module = self.DummyNNModule(spec, [23, 15])
        st = test_module()
        local_shard = st.local_tensor()
        test_module = _collect_local_shard(test_module)
        output = test_module()
        self.assertTrue(isinstance(output, torch.Tensor))
        self.assertEqual(local_shard, output)


class TestLocalTensor(ShardedTensorTestBase):
    @with_comms(init_rpc=False)
    def test_local_tensor(self):
        spec = ChunkShardingSpec(dim=0, placements=list(ROWS))
        st = sharded_tensor.rand(spec, 24, 12)
        local_shard = st.local_tensor()
        self.assertEqual(torch.Size([6, 12]), local_shard.size())
        self.assertEqual(st.local_tensor(), local_shard)

    @with_comms(init_rpc=False)
    def test_local_tensor_error(self):
        spec = ChunkShardingSpec(
            dim=0,
            placements=[
                "rank:0/cpu",
                "rank:0/cpu",
                "rank:1/cpu",
                "rank:1/cpu",
                "rank:1/cpu",
                "rank:2/cpu",
                "rank:2/cpu",
                "rank:2/cpu",
                "rank:3/cpu",
                "rank:3/cpu",
            ],
        )
        st = sharded_tensor.rand(spec, 24, 12)
        with self.assertRaisesRegex(NotImplementedError, "Only single local shard is supported."):
            st.local_tensor()


class TestShardedTensorChunked(ShardedTensorTestBase):
    @with_comms
    def test_create_sharded_tensor_with_ones(self):
        """Test sharded_tensor.ones(...)"""
        spec = ChunkShardingSpec(dim=0, placements=list(ROWS))
        h, w = 10, 20
        st = sharded_tensor.ones(spec, h, w)

        # Validate local shard is initialized with torch.ones
        local_shards = st.local_shards()
        self.assertEqual(1, len(local_shards))
        local_shard = local_shards[0].tensor
        self.assertEqual(DEVICE, local_shard.device)
        # The split: for rank!=3 ceil(h/4)=3  for rank=3 1
        expected_h = 1 if self.rank == 3 else math.ceil(h / 4)
        self.assertEqual((expected_h, w), local_shard.size())
        self.assertEqual(local_shard, torch.ones(expected_h, w))

    @with_comms
    def test_gather_even(self) -> None:
        """Test _sharded_tensor.gather(...) with evenly distributed._shards"""
        spec = ChunkShardingSpec(dim=0, placements=list(ROWS))
        h, w = 10, 20
        st = sharded_tensor.ones(spec, h, w)

        full_tensor = None
        dst = 1
        if self.rank == dst:
            full_tensor = torch.zeros(h, w, device=DEVICE)
        st.gather(dst, full_tensor)

        if self.rank == dst:
            self.assertEqual(full_tensor, torch.ones(h, w))
        else:
            self.assertIsNone(full_tensor)

    @with_comms
    def test_gather_uneven(self) -> None:
        """Test _sharded_tensor.gather(...) with unevenly distributed._shards"""
        spec = ChunkShardingSpec(
            dim=0,
            placements=[
                "rank:0/cpu",
                "rank:0/cpu",
                "rank:1/cpu",
                "rank:1/cpu",
                "rank:2/cpu",
            ],
        )
        h, w = 10, 20
        st = sharded_tensor.ones(spec, h, w)

        full_tensor = None
        dst = 1
        if self.rank == dst:
            full_tensor = torch.zeros(h, w, device=DEVICE)
        st.gather(dst, full_tensor)

        if self.rank == dst:
            self.assertEqual(full_tensor, torch.ones(h, w))
        else:
            self.assertIsNone(full_tensor)

    @with_comms
    def test_create_sharded_tensor_with_zeros(self):
        """Test sharded_tensor.zeros(...)"""
        spec = ChunkShardingSpec(dim=0, placements=list(ROWS))
        h, w = 10, 20
        st = sharded_tensor.zeros(spec, h, w)

        # Validate local shard is initialized with torch.zeros
        local_shards = st.local_shards()
        self.assertEqual(1, len(local_shards))
        local_shard = local_shards[0].tensor
        self.assertEqual(DEVICE, local_shard.device)
        # The split: for rank!=3 ceil(h/4)=3  for rank=3 1
        expected_h = 1 if self.rank == 3 else math.ceil(h / 4)
        self.assertEqual((expected_h, w), local_shard.size())
        self.assertEqual(local_shard, torch.zeros(expected_h, w))

    @differs_on_shardwise("seeded-rand")
    @with_comms
    def test_create_sharded_tensor_with_rand(self):
        """Test sharded_tensor.rand(...)/randn(...)"""
        spec = ChunkShardingSpec(dim=0, placements=list(ROWS))
        h, w = 8, 2
        seed = 1234

        expected_h = 2
        expected_device = DEVICE
        dtype = torch.double
        torch.manual_seed(seed)
        # Test sharded_tensor.rand creation
        expected = torch.rand(expected_h, w, device=expected_device, dtype=dtype)
        # reset seed to ensure the same random numbers are generated
        torch.manual_seed(seed)
        st = sharded_tensor.rand(spec, h, w, dtype=dtype)

        # Validate local shard is initialized with torch.rand
        local_shards = st.local_shards()
        self.assertEqual(1, len(local_shards))
        local_shard = local_shards[0].tensor
        self.assertEqual(expected_device, local_shard.device)
        self.assertEqual((expected_h, w), local_shard.size())
        self.assertEqual(expected, local_shard)

        # Test sharded_tensor.randn creation
        torch.manual_seed(seed)
        expected_randn = torch.randn(expected_h, w, device=expected_device, dtype=dtype)
        # reset seed to ensure the same random numbers are generated
        torch.manual_seed(seed)
        st_randn = sharded_tensor.randn(spec, h, w, dtype=dtype)

        # Validate local shard is initialized with torch.randn
        local_shards = st_randn.local_shards()
        self.assertEqual(1, len(local_shards))
        local_shard = local_shards[0].tensor
        self.assertEqual(expected_device, local_shard.device)
        self.assertEqual((expected_h, w), local_shard.size())
        self.assertEqual(expected_randn, local_shard)

    @with_comms
    def test_create_sharded_tensor_with_full(self):
        """Test sharded_tensor.full(...)"""
        spec = ChunkShardingSpec(dim=0, placements=list(ROWS))
        h, w = 10, 20
        fill_value = 1234
        st = sharded_tensor.full(spec, size=(h, w), fill_value=fill_value, dtype=torch.int32)

        # Validate local shard is initialized with torch.full
        local_shards = st.local_shards()
        self.assertEqual(1, len(local_shards))
        local_shard = local_shards[0].tensor
        self.assertEqual(DEVICE, local_shard.device)
        # The split: for rank!=3 ceil(h/4)=3  for rank=3 1
        expected_h = 1 if self.rank == 3 else math.ceil(h / 4)
        self.assertEqual((expected_h, w), local_shard.size())
        self.assertEqual(
            local_shard,
            torch.full(size=(expected_h, w), fill_value=fill_value, dtype=torch.int32),
        )

    @differs_on_shardwise("seeded-rand")
    @with_comms
    def test_create_sharded_tensor_like(self):
        """Test tensor like methods, i.e. torch.zeros_like(...), torch.full_like, etc."""
        spec = ChunkShardingSpec(dim=0, placements=list(ROWS))
        h, w = 8, 8
        expected_h = 2
        seed = 1234
        dtype = torch.double
        expected_device = DEVICE
        st = sharded_tensor.rand(spec, (h, w), dtype=dtype)
        tensor_like_ops = {
            torch.zeros_like: torch.zeros,
            torch.ones_like: torch.ones,
            torch.rand_like: torch.rand,
            torch.randn_like: torch.randn,
            torch.empty_like: torch.empty,
            torch.full_like: torch.full,
        }
        for op, expect_local_op in tensor_like_ops.items():
            if op == torch.full_like:
                # special handle full/full_like as it needs to have additional fill_value arg
                expect_tensor = expect_local_op((expected_h, w), 8.8, device=expected_device, dtype=dtype)
                new_op_st = op(st, 8.8, dtype=dtype)
                self.assertEqual(new_op_st.local_tensor(), expect_tensor)
            elif op == torch.empty_like:
                # empty/empty_like we only compare the shape
                expect_tensor = expect_local_op(expected_h, w, device=expected_device, dtype=dtype)
                new_op_st = op(st, dtype=dtype)
                self.assertEqual(new_op_st.local_tensor().shape, expect_tensor.shape)
            else:
                torch.manual_seed(seed)
                expect_tensor = expect_local_op(expected_h, w, device=expected_device, dtype=dtype)
                torch.manual_seed(seed)
                new_op_st = op(st, dtype=dtype)
                self.assertEqual(new_op_st.local_tensor(), expect_tensor)

    def test_sharding_columns(self):
        self.init_pg()

        for dim in [1, -1]:
            spec = ChunkShardingSpec(dim=dim, placements=list(ROWS))

            st = sharded_tensor.empty(spec, 10, 32)

            # Validate local shard.
            local_shards = st.local_shards()
            self.assertEqual(1, len(local_shards))
            local_shard = local_shards[0].tensor
            self.assertEqual(DEVICE, local_shard.device)
            self.assertEqual((10, 8), local_shard.size())

            # Validate global metadata.
            st_metadata = st.metadata()
            shards_metadata = st_metadata.shards_metadata
            self.assertEqual(4, len(shards_metadata))

            for rank, shard_metadata in enumerate(shards_metadata):
                self.assertEqual([0, rank * 8], shard_metadata.shard_offsets)
                self.assertEqual([10, 8], shard_metadata.shard_sizes)
                self.assertEqual(f"rank:{rank}/cpu", str(shard_metadata.placement))

    @out_of_scope(
        "RPC: ends with init_rpc() and a worker-name placement; before that, worker-name placements and "
        "init_rrefs=True without RPC (run it with TORCH_SUITE_INCLUDE_OUT_OF_SCOPE=1: the harness has no "
        "init_rpc, so it gets as far as that call)"
    )
    def test_invalid_sharding(self):
        self.init_pg()

        with self.assertRaisesRegex(NotImplementedError, "does not support named dimension"):
            spec = ChunkShardingSpec(dim="H", placements=["rank:1/cpu"])
            sharded_tensor.empty(spec, 10, 20)

        for dim in [2, 3, 4, -3, -4, -5]:
            spec = ChunkShardingSpec(dim=dim, placements=["rank:1/cpu"])
            with self.assertRaisesRegex(ValueError, "Invalid sharding dim"):
                sharded_tensor.empty(spec, 10, 20)

        spec = ChunkShardingSpec(dim=0, placements=["rank:5/cpu"])
        with self.assertRaisesRegex(ValueError, "Global rank 5 does not exist in input process group"):
            sharded_tensor.empty(spec, 10, 20)

        spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu"])
        st = sharded_tensor.empty(spec, 10, 20)
        tensor = torch.empty(10, 20)
        with self.assertRaisesRegex(RuntimeError, r".*not supported for ShardedTensor!$"):
            torch.add(st, tensor)

        spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu"])
        with self.assertRaisesRegex(ValueError, "Only torch.strided layout is currently supported"):
            sharded_tensor.empty(spec, 10, 20, layout=torch.sparse_coo)

        spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu"])
        with self.assertRaisesRegex(
            ValueError,
            "Only torch.contiguous_format memory_format is currently supported",
        ):
            sharded_tensor.empty(spec, 10, 20, memory_format=torch.channels_last)

        spec = ChunkShardingSpec(dim=0, placements=["worker0/cpu"])
        with self.assertRaisesRegex(RuntimeError, "RPC framework needs to be initialized"):
            sharded_tensor.empty(spec, 10, 20)

        spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu"])
        with self.assertRaisesRegex(RuntimeError, "RPC Framework needs to be initialized"):
            st = sharded_tensor.empty(spec, 10, 20, init_rrefs=True)

        with self.assertRaisesRegex(RuntimeError, "ShardedTensor created with init_rrefs=False"):
            st = sharded_tensor.empty(spec, 10, 20)
            st.remote_shards()

        self.init_rpc()
        spec = ChunkShardingSpec(dim=0, placements=["workerfoo/cpu"])
        with self.assertRaisesRegex(ValueError, "Invalid worker name"):
            sharded_tensor.empty(spec, 10, 20, init_rrefs=True)

    @differs_on_shardwise("empty-chunk-offset")
    def test_insufficient_sharding_dims(self):
        self.init_pg()

        spec = ChunkShardingSpec(dim=0, placements=list(ROWS))
        st = sharded_tensor.empty(spec, 2, 20)

        # Validate local shard.
        local_shards = st.local_shards()
        if self.rank <= 1:
            self.assertEqual(1, len(local_shards))
            local_shard = local_shards[0].tensor
            self.assertEqual(DEVICE, local_shard.device)
            self.assertEqual((1, 20), local_shard.size())
        else:
            self.assertEqual(1, len(local_shards))
            local_shard = local_shards[0].tensor
            self.assertEqual(DEVICE, local_shard.device)
            self.assertEqual(local_shard.numel(), 0)

        # Validate global metadata.
        st_metadata = st.metadata()
        shards_metadata = st_metadata.shards_metadata
        self.assertEqual(4, len(shards_metadata))

        for shard_rank, shard_metadata in enumerate(shards_metadata):
            self.assertEqual([shard_rank, 0], shard_metadata.shard_offsets)
            self.assertEqual(f"rank:{shard_rank}/cpu", str(shard_metadata.placement))
            if shard_rank <= 1:
                self.assertEqual([1, 20], shard_metadata.shard_sizes)
            else:
                self.assertEqual([0, 20], shard_metadata.shard_sizes)

    @with_comms
    def test_state_dict_no_sharded_tensors(self):
        # Verify hooks don't affect modules with no ShardedTensors.
        m = torch.nn.Linear(10, 10)

        # Test save
        state_dict_before = m.state_dict()
        m._register_state_dict_hook(state_dict_hook)
        buffer = io.BytesIO()
        torch.save(m.state_dict(), buffer)
        self.assertEqual(state_dict_before, m.state_dict())

        # Test load.
        module_load = torch.nn.Linear(10, 10)
        module_load._register_load_state_dict_pre_hook(pre_load_state_dict_hook, True)

        buffer.seek(0)
        state_dict_deser = torch.load(buffer)
        module_load.load_state_dict(state_dict_deser, strict=False)

        # Verify after load.
        self.assertEqual(m.weight, module_load.weight)
        self.assertEqual(m.bias, module_load.bias)


class TestShardedTensorEnumerable(ShardedTensorTestBase):
    def test_uneven_shards(self):
        self.init_pg()

        spec = EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[2, 4], placement="rank:0/cpu"),
                ShardMetadata(shard_offsets=[0, 4], shard_sizes=[4, 2], placement="rank:1/cpu"),
                ShardMetadata(shard_offsets=[2, 0], shard_sizes=[4, 4], placement="rank:2/cpu"),
                ShardMetadata(shard_offsets=[4, 4], shard_sizes=[2, 2], placement="rank:3/cpu"),
            ]
        )

        st = sharded_tensor.empty(spec, 6, 6)
        self.assertEqual((6, 6), st.size())
        self.assertEqual(1, len(st.local_shards()))

        def verify_size(rank, tensor_dims):
            if rank == 0:
                self.assertEqual((2, 4), tensor_dims)
            elif rank == 1:
                self.assertEqual((4, 2), tensor_dims)
            elif rank == 2:
                self.assertEqual((4, 4), tensor_dims)
            elif rank == 3:
                self.assertEqual((2, 2), tensor_dims)

        def verify_offsets(rank, offsets):
            if rank == 0:
                self.assertEqual((0, 0), offsets)
            elif rank == 1:
                self.assertEqual((0, 4), offsets)
            elif rank == 2:
                self.assertEqual((2, 0), offsets)
            elif rank == 3:
                self.assertEqual((4, 4), offsets)

        # Verify local shard.
        local_shard = st.local_shards()[0]
        self.assertEqual(DEVICE, local_shard.tensor.device)
        verify_size(self.rank, local_shard.tensor.size())

        # Verify local shard metadata.
        verify_offsets(self.rank, local_shard.metadata.shard_offsets)
        verify_size(self.rank, local_shard.metadata.shard_sizes)
        self.assertEqual(f"rank:{self.rank}/cpu", str(local_shard.metadata.placement))

        # Verify global metadata.
        st_metadata = st.metadata()
        shards_metadata = st_metadata.shards_metadata
        self.assertEqual(4, len(shards_metadata))
        for rank, shard_metadata in enumerate(shards_metadata):
            verify_offsets(rank, shard_metadata.shard_offsets)
            verify_size(rank, shard_metadata.shard_sizes)
            self.assertEqual(f"rank:{rank}/cpu", str(shard_metadata.placement))


class TestShardedTensorFromLocalTensor(ShardedTensorTestBase):
    @with_comms
    def test_init_from_local_tensor_errors(self):
        enumerable_sharding_spec = EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 5], placement="rank:0/cpu"),
                ShardMetadata(shard_offsets=[5, 0], shard_sizes=[5, 5], placement="rank:1/cpu"),
            ]
        )
        st_size = [24, 12]
        local_tensor = torch.rand(*st_size)
        with self.assertRaisesRegex(ValueError, "do not cover the entire tensor"):
            ShardedTensor._init_from_local_tensor(
                local_tensor,
                enumerable_sharding_spec,
                st_size,
            )
        chunk_specs = _chunk_sharding_specs_list_for_test([0], seed=31)
        with self.assertRaisesRegex(ValueError, "local_tensor is not a contiguous Tensor."):
            ShardedTensor._init_from_local_tensor(
                local_tensor.t(),
                chunk_specs[0],
                st_size,
            )


class TestShardedTensorFromLocalShards(ShardedTensorTestBase):
    @with_comms(init_rpc=False)
    def test_local_shards(self):
        shard_offsets = [(self.rank // 2) * 5, (self.rank % 2) * 5]
        local_shard_metadata = ShardMetadata(
            shard_offsets=shard_offsets,
            shard_sizes=[5, 5],
            placement=f"rank:{self.rank}/cpu",
        )

        local_tensor = torch.randn(5, 5, device=DEVICE)
        local_shard = sharded_tensor.Shard(local_tensor, local_shard_metadata)
        local_shard_from_offsets = sharded_tensor.Shard.from_tensor_and_offsets(
            local_tensor, shard_offsets=shard_offsets, rank=self.rank
        )
        self.assertEqual(local_shard.metadata, local_shard_from_offsets.metadata)

        wrong_local_shard_metadata = ShardMetadata(
            shard_offsets=shard_offsets,
            shard_sizes=[6, 5],
            placement=f"rank:{self.rank}/cpu",
        )
        with self.assertRaisesRegex(ValueError, "Shard tensor size does not match"):
            sharded_tensor.Shard(local_tensor, metadata=wrong_local_shard_metadata)

    @with_comms(init_rpc=False)
    def test_recalc_for_metadata(self):
        shard_sizes = [0, 5]  # test 2 different shard sizes
        for shard_size in shard_sizes:
            local_shard_metadata = ShardMetadata(
                shard_offsets=[0, 0],
                shard_sizes=[shard_size, shard_size],
                placement=f"rank:{self.rank}/cpu",
            )

            local_shards = [
                sharded_tensor.Shard(
                    torch.randn(shard_size, shard_size, device=DEVICE),
                    local_shard_metadata,
                )
            ]

            st = sharded_tensor.init_from_local_shards(local_shards, None, None)
            self.assertEqual((shard_size * 4, shard_size), st.size())
            self.assertEqual(1, len(st.local_shards()))

            # Verify local shard.
            local_shard = st.local_shards()[0]
            self.assertEqual(DEVICE, local_shard.tensor.device)
            self.assertEqual((shard_size, shard_size), local_shard.tensor.size())

            # Verify local shard metadata.
            self.assertEqual(
                (self.rank * shard_size, 0),
                local_shard.metadata.shard_offsets,
            )
            self.assertEqual((shard_size, shard_size), local_shard.metadata.shard_sizes)
            self.assertEqual(
                f"rank:{self.rank}/cpu",
                str(local_shard.metadata.placement),
            )

            # Verify global metadata.
            shards_metadata = st.metadata().shards_metadata
            self.assertEqual(4, len(shards_metadata))
            for rank, shard_metadata in enumerate(shards_metadata):
                self.assertEqual((rank * shard_size, 0), shard_metadata.shard_offsets)
                self.assertEqual((shard_size, shard_size), shard_metadata.shard_sizes)
                self.assertEqual(f"rank:{rank}/cpu", str(shard_metadata.placement))

            with self.assertRaises(ValueError):
                st = sharded_tensor.init_from_local_shards(local_shards)

    @with_comms(init_rpc=False)
    def test_init_from_local_shards_with_different_glb_size(self):
        wrong_offset_local_shard_metadata = ShardMetadata(
            shard_offsets=[0, 0],
            shard_sizes=[5, 5],
            placement=f"rank:{self.rank}/cpu",
        )

        wrong_offset_local_shards = [
            sharded_tensor.Shard(
                torch.randn(5, 5, device=DEVICE),
                wrong_offset_local_shard_metadata,
            )
        ]
        with self.assertRaises(ValueError):
            sharded_tensor.init_from_local_shards(wrong_offset_local_shards, 0, 0)

        local_shard_metadata = ShardMetadata(
            shard_offsets=[self.rank * 5, 0],
            shard_sizes=[5, 5],
            placement=f"rank:{self.rank}/cpu",
        )

        local_shards = [sharded_tensor.Shard(torch.randn(5, 5, device=DEVICE), local_shard_metadata)]
        with self.assertRaises(ValueError):
            sharded_tensor.init_from_local_shards(local_shards, 0, 0)

    @with_comms(init_rpc=False)
    def test_non_rw_sharded_recalc_for_metadata(self):
        local_shard_metadata = ShardMetadata(
            shard_offsets=[(self.rank // 2) * 5, (self.rank % 2) * 5],
            shard_sizes=[5, 5],
            placement=f"rank:{self.rank}/cpu",
        )

        local_shards = [sharded_tensor.Shard(torch.randn(5, 5, device=DEVICE), local_shard_metadata)]

        st = sharded_tensor.init_from_local_shards(local_shards, None, 5)
        if self.rank == 0:
            self.assertEqual(
                st.local_shards()[0].metadata.shard_offsets,
                local_shard_metadata.shard_offsets,
            )
        else:
            self.assertNotEqual(
                st.local_shards()[0].metadata.shard_offsets,
                local_shard_metadata.shard_offsets,
            )
        self.assertEqual(st.local_shards()[0].metadata.shard_sizes, local_shard_metadata.shard_sizes)
        self.assertEqual(st.local_shards()[0].metadata.placement, local_shard_metadata.placement)

    def test_st_base_init_from_local_shards_and_global_metadata(self):
        world_size = 4
        shards_metadata = []
        shards = []
        for rank in range(world_size):
            local_shard_metadata = ShardMetadata(
                shard_offsets=[(rank // 2) * 5, (rank % 2) * 5],
                shard_sizes=[5, 5],
                placement=f"rank:{rank}/cpu",
            )
            shards_metadata.append(local_shard_metadata)
            shards.append(sharded_tensor.Shard(torch.randn(5, 5, device=DEVICE), local_shard_metadata))

        tensor_properties = TensorProperties(
            dtype=torch.get_default_dtype(),
            layout=torch.strided,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=False,
        )

        sharded_tensor_metadata = sharded_tensor.ShardedTensorMetadata(
            shards_metadata=shards_metadata,
            size=torch.Size([10, 10]),
            tensor_properties=tensor_properties,
        )

        st_base = sharded_tensor.ShardedTensorBase._init_from_local_shards_and_global_metadata(
            shards, sharded_tensor_metadata=sharded_tensor_metadata
        )
        self.assertEqual(4, len(st_base.local_shards()))

        # Verify local shard of st_base
        local_shard = st_base.local_shards()[0]
        self.assertEqual(torch.device("cpu"), local_shard.tensor.device)
        self.assertEqual((5, 5), local_shard.tensor.size())

        # Verify local shard metadata.
        self.assertEqual(
            (0, 0),
            local_shard.metadata.shard_offsets,
        )
        self.assertEqual((5, 5), local_shard.metadata.shard_sizes)
        self.assertEqual("rank:0/cpu", str(local_shard.metadata.placement))

        # Verify global metadata.
        shards_metadata = st_base.metadata().shards_metadata
        self.assertEqual(4, len(shards_metadata))
        for rank, shard_metadata in enumerate(shards_metadata):
            self.assertEqual((rank // 2 * 5, (rank % 2) * 5), shard_metadata.shard_offsets)
            self.assertEqual((5, 5), shard_metadata.shard_sizes)
            self.assertEqual(f"rank:{rank}/cpu", str(shard_metadata.placement))

    @with_comms(init_rpc=False)
    def test_init_from_local_shards_and_global_metadata_with_all_zeros(self):
        local_shard_metadata = ShardMetadata(
            shard_offsets=[0, 0],
            shard_sizes=[0, 0],
            placement=f"rank:{self.rank}/cpu",
        )

        shards_metadata = []
        for r in range(self.world_size):
            if r == self.rank:
                shards_metadata.append(local_shard_metadata)
            else:
                shards_metadata.append(
                    ShardMetadata(
                        shard_offsets=[0, 0],
                        shard_sizes=[0, 0],
                        placement=f"rank:{r}/cpu",
                    )
                )

        local_shards = [sharded_tensor.Shard(torch.randn(0, 0, device=DEVICE), local_shard_metadata)]

        tensor_properties = TensorProperties(
            dtype=torch.get_default_dtype(),
            layout=torch.strided,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=False,
        )

        sharded_tensor_metadata = sharded_tensor.ShardedTensorMetadata(
            shards_metadata=shards_metadata,
            size=torch.Size([0, 0]),
            tensor_properties=tensor_properties,
        )

        st = ShardedTensor._init_from_local_shards_and_global_metadata(
            local_shards,
            sharded_tensor_metadata,
        )

        self.assertEqual((0, 0), st.size())
        self.assertEqual(1, len(st.local_shards()))

        # Verify local shard.
        local_shard = st.local_shards()[0]
        self.assertEqual(DEVICE, local_shard.tensor.device)
        self.assertEqual((0, 0), local_shard.tensor.size())

        # Verify local shard metadata.
        self.assertEqual(
            (0, 0),
            local_shard.metadata.shard_offsets,
        )
        self.assertEqual((0, 0), local_shard.metadata.shard_sizes)
        self.assertEqual(f"rank:{self.rank}/cpu", str(local_shard.metadata.placement))

        # Verify global metadata.
        shards_metadata = st.metadata().shards_metadata
        self.assertEqual(4, len(shards_metadata))
        for rank, shard_metadata in enumerate(shards_metadata):
            self.assertEqual((0, 0), shard_metadata.shard_offsets)
            self.assertEqual((0, 0), shard_metadata.shard_sizes)
            self.assertEqual(f"rank:{rank}/cpu", str(shard_metadata.placement))

    @with_comms(init_rpc=False)
    def test_init_from_local_shards_and_global_metadata_with_local_view(self):
        # testing cases where we create ST with local view, meaning we initialize other rank's metadata with 0s
        shard_offsets = [0, 1]  # valid, invalid
        for shard_offset in shard_offsets:
            local_shard_metadata = ShardMetadata(
                shard_offsets=[shard_offset, 0],
                shard_sizes=[5, 5],
                placement=f"rank:{self.rank}/cpu",
            )

            shards_metadata = []
            for r in range(self.world_size):
                if r == self.rank:
                    shards_metadata.append(local_shard_metadata)
                else:
                    shards_metadata.append(
                        ShardMetadata(
                            shard_offsets=[0 if r < self.rank else 5, 0],
                            shard_sizes=[0, 0],
                            placement=f"rank:{r}/cpu",
                        )
                    )

            local_shards = [sharded_tensor.Shard(torch.randn(5, 5, device=DEVICE), local_shard_metadata)]

            tensor_properties = TensorProperties(
                dtype=torch.get_default_dtype(),
                layout=torch.strided,
                requires_grad=False,
                memory_format=torch.contiguous_format,
                pin_memory=False,
            )

            sharded_tensor_metadata = sharded_tensor.ShardedTensorMetadata(
                shards_metadata=shards_metadata,
                size=torch.Size([5, 5]),
                tensor_properties=tensor_properties,
            )
            if shard_offset == 0:
                # valid case
                st = ShardedTensor._init_from_local_shards_and_global_metadata(
                    local_shards,
                    sharded_tensor_metadata,
                )
            else:
                # invalid case
                with self.assertRaises(ValueError):
                    ShardedTensor._init_from_local_shards_and_global_metadata(
                        local_shards,
                        sharded_tensor_metadata,
                    )
                return

            self.assertEqual((5, 5), st.size())
            self.assertEqual(1, len(st.local_shards()))

            # Verify local shard.
            local_shard = st.local_shards()[0]
            self.assertEqual(DEVICE, local_shard.tensor.device)
            self.assertEqual((5, 5), local_shard.tensor.size())

            # Verify local shard metadata.
            self.assertEqual(
                (0, 0),
                local_shard.metadata.shard_offsets,
            )
            self.assertEqual((5, 5), local_shard.metadata.shard_sizes)
            self.assertEqual(
                f"rank:{self.rank}/cpu",
                str(local_shard.metadata.placement),
            )

            # Verify global metadata.
            shards_metadata = st.metadata().shards_metadata
            self.assertEqual(4, len(shards_metadata))
            for rank, shard_metadata in enumerate(shards_metadata):
                self.assertEqual((0 if rank <= self.rank else 5, 0), shard_metadata.shard_offsets)
                if rank == self.rank:
                    self.assertEqual((5, 5), shard_metadata.shard_sizes)
                else:
                    self.assertEqual((0, 0), shard_metadata.shard_sizes)
                self.assertEqual(f"rank:{rank}/cpu", str(shard_metadata.placement))

    @torch_pg_only("dist.new_group(ranks=[1, 2, 3])")
    @with_comms
    def test_init_from_local_shards_new_group(self):
        new_pg = dist.new_group(ranks=[1, 2, 3])

        if self.rank != 0:
            local_shard_metadata = ShardMetadata(
                shard_offsets=[5 * (self.rank - 1), 0],
                shard_sizes=[5, 5],
                placement=f"rank:{self.rank}/cpu",
            )
            local_shards = [sharded_tensor.Shard(torch.randn(5, 5, device=DEVICE), local_shard_metadata)]

            st = sharded_tensor.init_from_local_shards(local_shards, [15, 5], process_group=new_pg)

            # Verify local shard.
            local_shard = st.local_shards()[0]
            self.assertEqual(DEVICE, local_shard.tensor.device)
            self.assertEqual((5, 5), local_shard.tensor.size())

            # Verify local shard metadata.
            self.assertEqual(((self.rank - 1) * 5, 0), local_shard.metadata.shard_offsets)
            self.assertEqual((5, 5), local_shard.metadata.shard_sizes)
            self.assertEqual(
                f"rank:{self.rank}/cpu",
                str(local_shard.metadata.placement),
            )

            # Verify global metadata.
            st_metadata = st.metadata()
            shards_metadata = st_metadata.shards_metadata
            self.assertEqual(3, len(shards_metadata))
            for rank, shard_metadata in enumerate(shards_metadata):
                self.assertEqual((rank * 5, 0), shard_metadata.shard_offsets)
                self.assertEqual((5, 5), shard_metadata.shard_sizes)
                self.assertEqual(f"rank:{rank + 1}/cpu", str(shard_metadata.placement))

    @with_comms
    def test_init_from_local_shards_invalid_local_shards(self):
        local_shard_metadata = ShardMetadata(
            shard_offsets=[(self.rank // 2) * 5, (self.rank % 2) * 5],
            shard_sizes=[5, 5],
            placement=f"rank:{self.rank}/cpu",
        )

        indices = [[0, 1, 1], [2, 0, 2]]
        values = [3.2, 4.5, 5.8]
        sparse_tensor = torch.sparse_coo_tensor(indices, values, (5, 5), device=DEVICE)

        empty_local_shards = []
        with self.assertRaisesRegex(ValueError, "have no local shards on all ranks"):
            sharded_tensor.init_from_local_shards(empty_local_shards, [10, 10], init_rrefs=True)

        wrong_layout_shards = [sharded_tensor.Shard(sparse_tensor, local_shard_metadata)]
        with self.assertRaisesRegex(ValueError, "Only torch.strided layout is currently supported"):
            sharded_tensor.init_from_local_shards(wrong_layout_shards, [10, 10], init_rrefs=True)

        wrong_memory_format_shards = [
            sharded_tensor.Shard(torch.randn(5, 5, device=DEVICE).t(), local_shard_metadata)
        ]
        with self.assertRaisesRegex(
            ValueError,
            "Only torch.contiguous_format memory_format is currently supported",
        ):
            sharded_tensor.init_from_local_shards(wrong_memory_format_shards, [10, 10], init_rrefs=True)

        with self.assertRaisesRegex(ValueError, "Shard tensor size does not match"):
            sharded_tensor.Shard(torch.randn(2, 3, device=DEVICE), local_shard_metadata)

        with self.assertRaisesRegex(ValueError, "Local shard tensor device does not match"):
            # port: upstream's tensor is on the CPU while the placement is
            # cuda:R; the placement is cpu here, so the other device is meta.
            sharded_tensor.Shard(torch.randn(5, 5, device="meta"), local_shard_metadata)

    @with_comms
    def test_init_from_local_shards_invalid_property_cross_ranks(self):
        local_shard_metadata = ShardMetadata(
            shard_offsets=[(self.rank // 2) * 5, (self.rank % 2) * 5],
            shard_sizes=[5, 5],
            placement=f"rank:{self.rank}/cpu",
        )
        tensor_overall_size = [10, 10] if self.rank == 0 else [10, 5]
        wrong_dtype_shards = [sharded_tensor.Shard(torch.ones(5, 5, device=DEVICE), local_shard_metadata)]
        with self.assertRaisesRegex(
            ValueError,
            "ShardedTensor global_size property does not match from different ranks!",
        ):
            sharded_tensor.init_from_local_shards(wrong_dtype_shards, tensor_overall_size, init_rrefs=True)

        tensor_dtype = torch.int if self.rank == 0 else torch.float32
        wrong_dtype_shards = [
            sharded_tensor.Shard(
                torch.ones(5, 5, device=DEVICE, dtype=tensor_dtype),
                local_shard_metadata,
            )
        ]
        with self.assertRaisesRegex(
            ValueError,
            "ShardedTensor dtype property does not match from different ranks!",
        ):
            sharded_tensor.init_from_local_shards(wrong_dtype_shards, [10, 10], init_rrefs=True)

        tensor_requires_grad = self.rank == 0
        wrong_requires_grad_shards = [
            sharded_tensor.Shard(
                torch.randn(5, 5, device=DEVICE, requires_grad=tensor_requires_grad),
                local_shard_metadata,
            )
        ]
        with self.assertRaisesRegex(
            ValueError,
            "ShardedTensor requires_grad property does not match from different ranks!",
        ):
            sharded_tensor.init_from_local_shards(wrong_requires_grad_shards, [10, 10], init_rrefs=True)

        local_shard_metadata = ShardMetadata(
            shard_offsets=[(self.rank // 2) * 5, (self.rank % 2) * 5],
            shard_sizes=[5, 5],
            placement=f"rank:{self.rank}/cpu",
        )

    @with_comms
    def test_init_from_local_shards_invalid_shards_overlap(self):
        local_shard_size = [5, 5] if self.rank != 0 else [6, 6]
        local_shard_metadata = ShardMetadata(
            shard_offsets=[(self.rank // 2) * 5, (self.rank % 2) * 5],
            shard_sizes=local_shard_size,
            placement=f"rank:{self.rank}/cpu",
        )

        local_shards = [
            sharded_tensor.Shard(
                torch.randn(local_shard_size, device=DEVICE),
                local_shard_metadata,
            )
        ]

        with self.assertRaisesRegex(ValueError, "overlap"):
            sharded_tensor.init_from_local_shards(local_shards, [10, 10], init_rrefs=True)

    @with_comms
    def test_init_from_local_shards_invalid_shards_gaps(self):
        local_shard_size = [5, 5] if self.rank != 0 else [4, 4]
        local_shard_metadata = ShardMetadata(
            shard_offsets=[(self.rank // 2) * 5, (self.rank % 2) * 5],
            shard_sizes=local_shard_size,
            placement=f"rank:{self.rank}/cpu",
        )

        local_shards = [
            sharded_tensor.Shard(
                torch.randn(local_shard_size, device=DEVICE),
                local_shard_metadata,
            )
        ]

        with self.assertRaisesRegex(ValueError, "does not match tensor volume"):
            sharded_tensor.init_from_local_shards(local_shards, [10, 10], init_rrefs=True)

    @out_of_scope(
        "its last check builds a shard with pin_memory=True, which CPU-only torch refuses "
        "(the checks before it, e.g. a wrong number of local shards, run with TORCH_SUITE_INCLUDE_OUT_OF_SCOPE=1)"
    )
    @with_comms
    def test_init_from_local_shards_and_global_metadata_invalid_shards(self):
        local_shard_metadata = ShardMetadata(
            shard_offsets=[(self.rank // 2) * 5, (self.rank % 2) * 5],
            shard_sizes=[5, 5],
            placement=f"rank:{self.rank}/cpu",
        )

        shards_metadata = []
        for r in range(self.world_size):
            if r == self.rank:
                shards_metadata.append(local_shard_metadata)
            else:
                shards_metadata.append(
                    ShardMetadata(
                        shard_offsets=[(r // 2) * 5, (r % 2) * 5],
                        shard_sizes=[5, 5],
                        placement=f"rank:{r}/cpu",
                    )
                )

        tensor_properties = TensorProperties(
            dtype=torch.get_default_dtype(),
            layout=torch.strided,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=False,
        )

        sharded_tensor_metadata = sharded_tensor.ShardedTensorMetadata(
            shards_metadata=shards_metadata,
            size=torch.Size([10, 10]),
            tensor_properties=tensor_properties,
        )

        empty_local_shards = []
        with self.assertRaisesRegex(RuntimeError, "does not match number of local shards metadata"):
            ShardedTensor._init_from_local_shards_and_global_metadata(empty_local_shards, sharded_tensor_metadata)

        wrong_num_shards = [
            sharded_tensor.Shard(torch.randn(5, 5, device=DEVICE), local_shard_metadata),
            sharded_tensor.Shard(torch.randn(5, 5, device=DEVICE), local_shard_metadata),
        ]
        with self.assertRaisesRegex(RuntimeError, "does not match number of local shards metadata"):
            ShardedTensor._init_from_local_shards_and_global_metadata(wrong_num_shards, sharded_tensor_metadata)

        with self.assertRaisesRegex(ValueError, "Shard tensor size does not match with metadata.shard_lengths"):
            sharded_tensor.Shard(torch.randn(2, 3, device=DEVICE), local_shard_metadata)

        with self.assertRaisesRegex(
            ValueError,
            "Local shard tensor device does not match with local Shard's placement",
        ):
            # port: the mismatching device is meta (see test_init_from_local_shards_invalid_local_shards)
            sharded_tensor.Shard(torch.randn(5, 5, device="meta"), local_shard_metadata)

        wrong_dtype_shards = [
            sharded_tensor.Shard(
                torch.ones(5, 5, device=DEVICE, dtype=torch.int),
                local_shard_metadata,
            )
        ]
        with self.assertRaisesRegex(ValueError, "Local shards' tensor dtype property is incompatible with"):
            ShardedTensor._init_from_local_shards_and_global_metadata(wrong_dtype_shards, sharded_tensor_metadata)

        indices = [[0, 1, 1], [2, 0, 2]]
        values = [3.2, 4.5, 5.8]
        sparse_tensor = torch.sparse_coo_tensor(indices, values, (5, 5), device=DEVICE)

        wrong_layout_shards = [sharded_tensor.Shard(sparse_tensor, local_shard_metadata)]
        with self.assertRaisesRegex(ValueError, "Local shards' tensor layout property is incompatible with"):
            ShardedTensor._init_from_local_shards_and_global_metadata(wrong_layout_shards, sharded_tensor_metadata)

        wrong_requires_grad_shards = [
            sharded_tensor.Shard(
                torch.randn(5, 5, device=DEVICE, requires_grad=True),
                local_shard_metadata,
            )
        ]
        with self.assertRaisesRegex(
            ValueError,
            "Local shards' tensor requires_grad property is incompatible with",
        ):
            ShardedTensor._init_from_local_shards_and_global_metadata(
                wrong_requires_grad_shards, sharded_tensor_metadata
            )

        wrong_memory_format_shards = [
            sharded_tensor.Shard(torch.randn(5, 5, device=DEVICE).t(), local_shard_metadata)
        ]
        with self.assertRaisesRegex(
            ValueError,
            "Only torch.contiguous_format memory_format is currently supported",
        ):
            ShardedTensor._init_from_local_shards_and_global_metadata(
                wrong_memory_format_shards, sharded_tensor_metadata
            )
        # pin_memory can only be on CPU
        local_shard_metadata.placement = _remote_device(f"rank:{self.rank}/cpu")
        wrong_pin_memory_shards = [sharded_tensor.Shard(torch.randn(5, 5, pin_memory=True), local_shard_metadata)]
        with self.assertRaisesRegex(ValueError, "Local shards' tensor pin_memory property is incompatible with"):
            ShardedTensor._init_from_local_shards_and_global_metadata(
                wrong_pin_memory_shards, sharded_tensor_metadata
            )


class TestShardedTensorCustomOps(ShardedTensorTestBase):
    @with_comms
    def test_custom_op(self):
        @custom_sharded_op_impl(torch.asin)
        def my_sharded_asin(types, args, kwargs, process_group):
            return torch.asin(args[0].local_shards()[0].tensor)

        spec = ChunkShardingSpec(dim=0, placements=list(ROWS))

        st = sharded_tensor.rand(spec, 10, 10)
        res = torch.asin(st)
        self.assertEqual(res, torch.asin(st.local_shards()[0].tensor))

    @with_comms
    def test_custom_op_override(self):
        t = torch.rand(10, 10)

        custom_sharding_spec_op = load("sharding_spec.api", "custom_sharding_spec_op")

        @custom_sharding_spec_op(ChunkShardingSpec, torch.nn.functional.linear)
        def my_sharded_linear(types, args, kwargs, process_group):
            return t

        spec = ChunkShardingSpec(dim=0, placements=list(ROWS))
        m = torch.nn.Linear(32, 16).cpu()
        shard_parameter(m, "weight", spec)

        result = m(torch.rand(15, 32))
        self.assertEqual(t, result)

    @with_comms
    def test_custom_op_errors(self):
        with self.assertRaisesRegex(TypeError, "expects signature"):

            @custom_sharded_op_impl(torch.nn.functional.linear)
            def my_op1(types, args, kwargs, process_group, random_param):
                pass

        with self.assertRaisesRegex(TypeError, "expects signature"):

            @custom_sharded_op_impl(torch.nn.functional.linear)
            def my_op2(types):
                pass


class TestShardMetadata(ShardedTensorTestBase):
    @torch_pg_only("dist.distributed_c10d._get_default_group()")
    @with_comms
    def test_shard_metadata_init(self):
        pg = dist.distributed_c10d._get_default_group()

        md = ShardMetadata([10], [0])
        self.assertIsNone(md.placement)
        with self.assertRaisesRegex(ValueError, "remote device is None"):
            _parse_and_validate_remote_device(pg, md.placement)

        # String placement gets converted by ctor
        md = ShardMetadata([10], [0], "rank:0/cpu")
        self.assertEqual(md.placement, _remote_device("rank:0/cpu"))
        rank, device = _parse_and_validate_remote_device(pg, md.placement)
        self.assertEqual(0, rank)
        self.assertEqual(device, torch.device("cpu"))

    @with_comms
    def test_create_shard_with_no_placement(self):
        md = ShardMetadata([0], [10])
        shard = Shard(torch.zeros(10), md)
        self.assertIsNone(shard.metadata.placement)


class TestShardedTensorSubGroupInit(TestCase):
    @spawn_threads_and_init_comms(world_size=4)
    def test_sub_process_group_sharded_tensor_init(self):
        world_pg = dist.GroupMember.WORLD
        rank = dist.get_rank()

        sub_group_sz = 2
        sub_pg_ranks = [r for r in range(4) if r % sub_group_sz == rank % sub_group_sz]
        sub_pg = dist.new_group(
            sub_pg_ranks,
            backend=dist.get_backend(world_pg),
            use_local_synchronization=True,
        )
        dist.barrier(sub_pg)

        ShardedTensor._init_from_local_shards(
            [
                Shard(
                    tensor=torch.tensor([1, 2, 3], device="meta"),
                    metadata=ShardMetadata(
                        shard_offsets=[3 * (rank // sub_group_sz)],
                        shard_sizes=[3],
                        placement=f"rank:{rank}/meta",
                    ),
                )
            ],
            6,
            process_group=sub_pg,
        )

    @spawn_threads_and_init_comms(world_size=4)
    def test_sub_process_group_placement_validation(self):
        world_pg = dist.GroupMember.WORLD
        self.assertIsNotNone(world_pg)
        rank = dist.get_rank()

        sub_group_sz = 2
        sub_pg_ranks = [r for r in range(4) if r % sub_group_sz == rank % sub_group_sz]
        sub_pg = dist.new_group(
            sub_pg_ranks,
            backend=dist.get_backend(world_pg),
            use_local_synchronization=True,
        )
        dist.barrier(sub_pg)

        for r in sub_pg_ranks:
            _parse_and_validate_remote_device(sub_pg, _remote_device(f"rank:{r}/cpu"))


class TestCreateTensorNoProcessGroupMode(TestCase):
    def test_init_from_local_shards_and_global_metadata(self):
        st_metadata: ShardedTensorMetadata = ShardedTensorMetadata(
            shards_metadata=[
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[2, 2], placement="rank:0/cpu"),
                ShardMetadata(shard_offsets=[2, 0], shard_sizes=[2, 2], placement="rank:1/cpu"),
            ],
            size=torch.Size([4, 2]),
        )
        st_local_shards: list[Shard] = []
        for shard_metadata in st_metadata.shards_metadata:
            st_local_shards.append(
                Shard(
                    tensor=torch.zeros(
                        shard_metadata.shard_sizes,
                        device=shard_metadata.placement.device(),
                    ),
                    metadata=shard_metadata,
                )
            )

        ShardedTensorBase._init_from_local_shards_and_global_metadata(
            local_shards=st_local_shards,
            sharded_tensor_metadata=st_metadata,
        )

    def test_non_contiguous_local_shards(self):
        st_metadata: ShardedTensorMetadata = ShardedTensorMetadata(
            shards_metadata=[
                ShardMetadata(shard_offsets=[0, 0], shard_sizes=[2, 2], placement="rank:0/cpu"),
                ShardMetadata(shard_offsets=[2, 0], shard_sizes=[2, 2], placement="rank:1/cpu"),
            ],
            size=torch.Size([4, 2]),
        )
        st_local_shards: list[Shard] = []
        src = torch.randn(4, 2)
        for shard_metadata in st_metadata.shards_metadata:
            offsets = shard_metadata.shard_offsets
            sizes = shard_metadata.shard_sizes
            st_local_shards.append(
                Shard(
                    tensor=src[
                        offsets[0] : offsets[0] + sizes[0],
                        offsets[1] : offsets[1] + sizes[1],
                    ],
                    metadata=shard_metadata,
                )
            )

        ShardedTensorBase._init_from_local_shards_and_global_metadata(
            local_shards=st_local_shards,
            sharded_tensor_metadata=st_metadata,
        )
