"""Bring-up and tuning tools behind ``kunlun-infer doctor``, ``plan`` and ``bench``.

``doctor`` walks a new chip through six bring-up stages and stops at the
first failure, naming the layer, plugin and hook at fault (and writing a
pytest repro). ``memory_plan`` answers "how many KV blocks, how much
concurrency" for a model on a device — one you have or one you describe.
``bench`` measures throughput and latency, sweeps a config key and finds the
knee. Each is usable from Python as well as from the command line.
"""
