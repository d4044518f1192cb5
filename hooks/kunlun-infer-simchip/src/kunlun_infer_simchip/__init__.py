"""kunlun_infer_simchip: a simulated accelerator that lives on the CPU.

It exists to prove the framework free of CPU and CUDA assumptions without any
hardware. The chip has its own name and dtype set, a fixed-capacity memory
arena with 4 KiB alignment and 2 MiB granularity, asynchronous streams run by
worker threads, and a deliberately partial op set. Tensors are CPU torch
tensors underneath, carved out of the arena.

Rooms: ``config`` (the ``device=simchip`` options), ``arena`` (the chip's
memory), ``device``, ``memory`` (a caching allocator over the arena),
``streams`` (worker-thread streams and events), ``ops`` (the partial op set),
``attention`` and ``attention_kernels`` (its attention backend: Kunlun's cache
layout, decodes first, split decode and prefill kernels), ``plugin`` (the
hook implementations the entry point exposes).
"""

__version__ = "0.1.0"

#: what the simulated chip calls itself (its device, memory, ops and streams options share it)
CHIP_NAME = "simchip"
