"""What one tensor-parallel rank runs: the model shard, its KV pool shard, the sampler."""
