"""Tensor and pipeline parallelism: one engine's model split over ranks, each rank a process.

- :mod:`~kunlun_infer.engine.parallel.placement` — where this process stands
  (embedded rank 0, or a rank torchrun started) and the config that implies;
- :mod:`~kunlun_infer.engine.parallel.spawn` — starting and reaping the other
  ranks of an embedded run as child processes;
- :mod:`~kunlun_infer.engine.parallel.control_plane` — the messages rank 0
  broadcasts to tell the other ranks what to run;
- :mod:`~kunlun_infer.engine.parallel.driver` — rank 0: starts the group,
  loads the shards, drives every step, notices failures;
- :mod:`~kunlun_infer.engine.parallel.worker` — every other rank: loads its
  shard and runs what rank 0 says (``python -m kunlun_infer.engine.parallel.worker``).
- :mod:`~kunlun_infer.engine.parallel.stages` — pipeline stages: which
  layers each runs, and each rank's place in the ``pipeline × tensor`` grid;
- :mod:`~kunlun_infer.engine.parallel.pipeline` — the chain stages talk
  over (control messages, activations, failures, logits, point to point);
- :mod:`~kunlun_infer.engine.parallel.pipeline_driver` — rank 0 of a
  pipeline: sends each step down it, runs the first stage, samples.

The layers that split the weights are in :mod:`kunlun_infer.layers` (linear,
embedding); the collectives are the comm plugin's.
"""
