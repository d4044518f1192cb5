"""kunlun_infer_kunlun: Kunlun XPU (P800) through the vendor's PyTorch stack.

The vendor's ``torch_xmlir`` (xpytorch) exposes the XPU through torch's CUDA
API and puts BKCL/XCCL behind torch.distributed's NCCL backend, so memory,
streams, ops and collectives reuse the classes of ``kunlun_infer_cuda``. What
is Kunlun's own lives here: ``detect`` (find the card and read the stack's
versions from ``xpu-smi`` and ``torch_xmlir``), ``matrix`` (which versions go
together, and the message naming a mismatched pair), ``visible``
(``XPU_VISIBLE_DEVICES``), ``tuning`` (BKCL variables from config),
``device``, ``comm``, ``config`` and ``plugin``; ``ops`` puts the op table
on the vendor's kernel library where ``vendor`` finds it.

This plugin has not been run on a Kunlun card: its detection and
version-matrix logic are tested with fakes only.
"""

__version__ = "0.1.0"
