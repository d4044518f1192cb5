"""kunlun_infer_cuda: NVIDIA GPUs through torch's CUDA stack.

Rooms: ``config`` (the Hydra options it adds), ``device`` (``torch.cuda``
device, identity, versions), ``memory`` (torch's caching allocator with its
statistics), ``streams`` (CUDA streams and events), ``comm`` (NCCL on a
private process group), ``ops`` (torch kernels, SDPA paged attention),
``plugin`` (the hook implementations of the entry point).

The classes are written against the CUDA API of torch, not against NVIDIA
alone, so a vendor stack that exposes its device through that API (as
Kunlun's does) can reuse them by subclassing.
"""

__version__ = "0.1.0"
