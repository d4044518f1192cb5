"""The engine room: scheduler, paged KV block manager, model runner, sampler and the engine loop.

``startup`` holds the decisions the engine makes from the config when it
starts (model folder, dtype, length, KV size); ``parallel`` holds tensor
parallelism (placement, spawning, control plane, rank 0's driver, the workers).
"""
