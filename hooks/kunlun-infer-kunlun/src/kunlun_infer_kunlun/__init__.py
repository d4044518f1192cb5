"""kunlun_infer_kunlun: Kunlun XPU (P800) through the vendor's PyTorch stack.

The vendor's xpytorch build (module ``torch_xmlir``) exposes the XPU through
torch's CUDA API and puts BKCL/XCCL behind torch.distributed's ``nccl``
backend, so memory and streams reuse the classes of ``kunlun_infer_cuda``.
What is Kunlun's own lives here: ``detect`` (``/dev/xpuctrl``, ``xpu-smi -i N
-q``, the installed distributions' versions), ``matrix`` (the combinations
seen in vendor deployments, and the message naming a mismatched pair),
``environment`` (settings that work against the plugin), ``visible``
(``XPU_VISIBLE_DEVICES``), ``tuning`` (BKCL variables from config),
``device``, ``comm``, ``config`` and ``plugin``; ``ops`` puts the op table
on the vendor's kernel library where ``vendor`` finds it.

This plugin has not been run on a Kunlun card: its detection, matrix and
comm logic are tested with fakes only (the README says which facts follow
published sources).
"""

__version__ = "0.1.0"
