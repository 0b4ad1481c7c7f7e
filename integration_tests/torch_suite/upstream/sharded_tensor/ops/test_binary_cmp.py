"""Port of pytorch/pytorch test/distributed/_shard/sharded_tensor/ops/test_binary_cmp.py (torch 2.13).

CPU/gloo instead of CUDA/NCCL; the sharding API through ``suite_target``.
"""

import torch
import torch.distributed as dist
from suite_harness import ShardedTensorTestBase, out_of_scope, torch_pg_only, with_comms
from suite_target import load
from torch.distributed.distributed_c10d import _get_default_group

sharded_tensor = load("sharded_tensor")
ChunkShardingSpec = load("sharding_spec", "ChunkShardingSpec")

PINNED = "pinned memory (sharded_tensor.ones(..., pin_memory=True)) needs an accelerator; CPU-only torch raises"


class TestShardedTensorBinaryOps(ShardedTensorTestBase):
    """Test base for binary comparison functions such as torch.equal, torch.allclose etc. for ShardedTensor"""

    seed = 42

    def get_random_tensors(self, spec1, spec2, *sizes, pg1=None, pg2=None, seed_offset=0):
        pg1 = _get_default_group() if pg1 is None else pg1
        pg2 = _get_default_group() if pg2 is None else pg2
        torch.manual_seed(TestShardedTensorBinaryOps.seed)
        st1 = sharded_tensor.rand(spec1, sizes, process_group=pg1)
        torch.manual_seed(TestShardedTensorBinaryOps.seed + seed_offset)
        st2 = sharded_tensor.rand(spec2, sizes, process_group=pg2)

        TestShardedTensorBinaryOps.seed += 1
        return st1, st2

    def get_gpu_specs(self):
        spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu", "rank:2/cpu", "rank:3/cpu"])
        alt_spec = ChunkShardingSpec(dim=0, placements=["rank:1/cpu", "rank:0/cpu", "rank:3/cpu", "rank:2/cpu"])
        return spec, alt_spec

    def _test_common_failures(self, cmp_op):
        spec, alt_spec = self.get_gpu_specs()

        st1, st2 = self.get_random_tensors(spec, spec, 10, 10)
        if self.rank == 0:
            torch.nn.init.uniform_(st1.local_shards()[0].tensor)
        self.assertFalse(cmp_op(st1, st2))

        st1 = sharded_tensor.ones(spec, 10, 10)
        st2 = sharded_tensor.ones(spec, 10, 5)
        self.assertFalse(cmp_op(st1, st2))

        st1, st2 = self.get_random_tensors(spec, alt_spec, 10, 10)
        self.assertFalse(cmp_op(st1, st2))

        st1 = sharded_tensor.ones(spec, 10, 10)
        st2 = sharded_tensor.zeros(spec, 10, 10)
        self.assertFalse(cmp_op(st1, st2))

        st1 = sharded_tensor.ones(spec, 10, 10)
        st2 = sharded_tensor.ones(spec, 10, 10, dtype=torch.double)
        self.assertFalse(cmp_op(st1, st2))

        st1 = sharded_tensor.ones(spec, 10, 10)
        st2 = sharded_tensor.ones(spec, 10, 10, requires_grad=True)
        self.assertFalse(cmp_op(st1, st2))

        cpu_spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu", "rank:2/cpu", "rank:3/cpu"])
        st1 = sharded_tensor.ones(cpu_spec, 10, 10)
        st2 = sharded_tensor.ones(cpu_spec, 10, 10, pin_memory=True)
        self.assertFalse(cmp_op(st1, st2))

        pg = dist.new_group([1, 0, 3, 2])
        st1, st2 = self.get_random_tensors(spec, spec, 10, 10, pg2=pg)
        with self.assertRaisesRegex(RuntimeError, "All distributed tensors should use the same ProcessGroup"):
            cmp_op(st1, st2)

        pg = dist.new_group([0, 1, 2, 3])
        st1, st2 = self.get_random_tensors(spec, spec, 10, 10, pg2=pg)
        with self.assertRaisesRegex(RuntimeError, "All distributed tensors should use the same ProcessGroup"):
            cmp_op(st1, st2)

    @out_of_scope(PINNED)
    @with_comms
    def test_torch_equal_tensor_specs(self):
        self._test_common_failures(torch.equal)

    @torch_pg_only("_get_default_group()")
    @with_comms
    def test_torch_equal(self):
        """Test torch.equal(ShardedTensor, ShardedTensor)"""
        spec, _ = self.get_gpu_specs()
        st1, st2 = self.get_random_tensors(spec, spec, 10, 10)
        self.assertTrue(torch.equal(st1, st2))

    @out_of_scope(PINNED)
    @with_comms
    def test_torch_allclose_tensor_specs(self):
        self._test_common_failures(torch.allclose)

    @torch_pg_only("_get_default_group()")
    @with_comms
    def test_torch_allclose(self):
        """Test torch.allclose(ShardedTensor, ShardedTensor)"""
        spec, _ = self.get_gpu_specs()

        st1, st2 = self.get_random_tensors(spec, spec, 10, 10)
        self.assertTrue(torch.allclose(st1, st2))
        self.assertTrue(torch.allclose(st1, st2, atol=0))

        # compare different arrays
        st1, st2 = self.get_random_tensors(spec, spec, 10, 10, seed_offset=1)
        self.assertFalse(torch.allclose(st1, st2))
        # sharded_tensor.rand produces uniform values in the [0,1] range.
        self.assertTrue(torch.allclose(st1, st2, atol=1))
