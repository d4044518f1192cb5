"""Mixture-of-experts layers: a router, experts stacked per layer, and how they split over ranks.

The ops they run on (hook API 1.4): ``moe_route`` chooses each token's
experts and weights, ``pack_moe_weights`` prepares the stacked expert weights
once after loading, ``fused_moe`` runs the chosen experts and combines them.
"""

from __future__ import annotations

#: ops a mixture-of-experts model needs besides the dense ones
MOE_OPS = ("moe_route", "pack_moe_weights", "fused_moe")
