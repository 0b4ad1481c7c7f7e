"""Port of pytorch/pytorch test/distributed/_shard/sharded_tensor/ops/test_tensor_ops.py (torch 2.13).

CPU/gloo instead of CUDA/NCCL; the sharding API through ``suite_target``.
"""

import copy

import torch
from suite_harness import ShardedTensorTestBase, with_comms
from suite_target import load

sharded_tensor = load("sharded_tensor")
ChunkShardingSpec = load("sharding_spec", "ChunkShardingSpec")

SPEC_PLACEMENTS = ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu", "rank:3/cpu"]


class TestTensorOps(ShardedTensorTestBase):
    @with_comms(init_rpc=False)
    def test_deep_copy(self):
        spec = ChunkShardingSpec(dim=0, placements=list(SPEC_PLACEMENTS))
        st = sharded_tensor.rand(spec, (12, 5))
        copied_st = copy.deepcopy(st)
        self.assertTrue(type(copied_st) is type(st))
        self.assertEqual(copied_st.local_tensor(), st.local_tensor())
        self.assertFalse(copied_st is st)

    @with_comms(init_rpc=False)
    def test_inplace_copy(self):
        spec = ChunkShardingSpec(dim=0, placements=list(SPEC_PLACEMENTS))
        st = sharded_tensor.rand(spec, (12, 5))
        ones_st = sharded_tensor.ones(spec, (12, 5))
        self.assertFalse(torch.equal(ones_st, st))
        st.copy_(ones_st)
        self.assertTrue(torch.equal(st, ones_st))

        # no grad inplace_copy should work between two with different requires_grad
        st_with_grad = sharded_tensor.rand(spec, (12, 5), requires_grad=True)
        self.assertTrue(st_with_grad.requires_grad)
        self.assertFalse(ones_st.requires_grad)
        with torch.no_grad():
            st_with_grad.copy_(ones_st)
            self.assertEqual(st_with_grad.local_tensor(), ones_st.local_tensor())

    @with_comms(init_rpc=False)
    def test_clone(self):
        spec = ChunkShardingSpec(dim=0, placements=list(SPEC_PLACEMENTS))
        st = sharded_tensor.rand(spec, (12, 5))
        copied_st = st.clone()
        self.assertTrue(type(copied_st) is type(st))
        self.assertEqual(copied_st.local_tensor(), st.local_tensor())
        self.assertFalse(copied_st is st)

    @with_comms(init_rpc=False)
    def test_detach(self):
        spec = ChunkShardingSpec(dim=0, placements=list(SPEC_PLACEMENTS))
        st = sharded_tensor.rand(spec, (12, 5), requires_grad=True)
        local_shards = st.local_shards()
        # before set requires_grad, all local shards should not require grads
        for local_shard in local_shards:
            self.assertTrue(local_shard.tensor.requires_grad)

        detached_st = st.detach()
        self.assertFalse(detached_st.requires_grad)

        for local_shard in detached_st.local_shards():
            self.assertFalse(local_shard.tensor.requires_grad)

    @with_comms(init_rpc=False)
    def test_set_requires_grad(self):
        spec = ChunkShardingSpec(dim=0, placements=list(SPEC_PLACEMENTS))
        st = sharded_tensor.rand(spec, (12, 5))
        local_shards = st.local_shards()
        # before set requires_grad, all local shards should not require grads
        for local_shard in local_shards:
            self.assertFalse(local_shard.tensor.requires_grad)

        st.requires_grad_()
        self.assertTrue(st.requires_grad)

        for local_shard in local_shards:
            self.assertTrue(local_shard.tensor.requires_grad)
