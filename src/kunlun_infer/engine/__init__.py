"""The engine room: scheduler, paged KV block manager, model runner, sampler and the engine loop."""
