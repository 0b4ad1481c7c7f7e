"""Port of pytorch/pytorch test/distributed/_shard/sharded_tensor/ops/test_init.py (torch 2.13).

CPU/gloo instead of CUDA/NCCL; the sharding API through ``suite_target``.
"""

import torch
from suite_harness import ShardedTensorTestBase, differs_on_shardwise, with_comms
from suite_target import load

sharded_tensor = load("sharded_tensor")
ChunkShardingSpec = load("sharding_spec", "ChunkShardingSpec")

SPEC_PLACEMENTS = ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu", "rank:3/cpu"]


class TestShardedTensorNNInit(ShardedTensorTestBase):
    """Testing torch.nn.init functions for ShardedTensor"""

    @differs_on_shardwise("seeded-rand")
    @with_comms
    def test_init_sharded_tensor_with_uniform(self):
        """Test torch.nn.init.uniform_(ShardedTensor, a, b)"""
        spec = ChunkShardingSpec(dim=0, placements=list(SPEC_PLACEMENTS))
        h, w = 8, 2
        a, b = 10, 20

        seed = 1234
        dtype = torch.double

        st = sharded_tensor.empty(spec, h, w, dtype=dtype)
        self.assertEqual(1, len(st.local_shards()))

        # Clone local tensor to ensure torch.nn.init starts from the same input
        local_tensor_clone = torch.clone(st.local_shards()[0].tensor)
        torch.manual_seed(seed)
        torch.nn.init.uniform_(st, a=a, b=b)

        torch.manual_seed(seed)
        torch.nn.init.uniform_(local_tensor_clone, a=a, b=b)
        self.assertEqual(local_tensor_clone, st.local_shards()[0].tensor)

    @differs_on_shardwise("seeded-rand")
    @with_comms
    def test_init_sharded_tensor_with_normal(self):
        """Test torch.nn.init.normal_(ShardedTensor, mean, std)"""
        spec = ChunkShardingSpec(dim=0, placements=list(SPEC_PLACEMENTS))
        h, w = 8, 2
        mean, std = 10, 5

        seed = 1234
        dtype = torch.double

        st = sharded_tensor.empty(spec, h, w, dtype=dtype)
        self.assertEqual(1, len(st.local_shards()))

        local_tensor_clone = torch.clone(st.local_shards()[0].tensor)
        torch.manual_seed(seed)
        torch.nn.init.normal_(st, mean=mean, std=std)

        torch.manual_seed(seed)
        torch.nn.init.normal_(local_tensor_clone, mean=mean, std=std)
        self.assertEqual(local_tensor_clone, st.local_shards()[0].tensor)

    @differs_on_shardwise("seeded-rand")
    @with_comms
    def test_init_sharded_tensor_with_kaiming_uniform(self):
        """Test torch.nn.init.kaiming_uniform_(ShardedTensor, a, mode, nonlinearit)"""
        spec = ChunkShardingSpec(dim=0, placements=list(SPEC_PLACEMENTS))
        h, w = 8, 2
        a, mode, nonlinearity = 0, "fan_in", "leaky_relu"

        seed = 1234
        dtype = torch.double

        st = sharded_tensor.empty(spec, h, w, dtype=dtype)
        self.assertEqual(1, len(st.local_shards()))

        local_tensor_clone = torch.clone(st.local_shards()[0].tensor)
        torch.manual_seed(seed)
        torch.nn.init.kaiming_uniform_(st, a=a, mode=mode, nonlinearity=nonlinearity)

        torch.manual_seed(seed)
        torch.nn.init.kaiming_uniform_(local_tensor_clone, a=a, mode=mode, nonlinearity=nonlinearity)
        self.assertEqual(local_tensor_clone, st.local_shards()[0].tensor)
