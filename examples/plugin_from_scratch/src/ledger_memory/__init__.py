"""ledger_memory: an example memory plugin for kunlun_infer, written from scratch.

``memory=ledger`` hands out 256-byte-aligned tensors on whatever device the
run uses, refuses to go beyond ``memory.limit`` bytes, and keeps a ledger of
live allocations that ``LedgerAllocator.ledger()`` reports.
"""

__version__ = "1.0.0"
