"""The LLaDA2-MoE model and its weights: config, the forward, checkpoint loading, tensor-parallel sharding, FP8, tiny test checkpoints, where a checkpoint lives."""
