"""FedAvg with batch normalization replaced: the GN and LN baselines of FedWon (Table 1).

FedAvg+GN uses GroupNorm with 32 groups (8 when a layer has fewer than 32
channels, else the largest divisor below that; FedWon appendix A.2, see
``mpifl.models.norm``); FedAvg+LN uses GroupNorm with a single group, a
layer norm over (C, H, W).  Neither keeps running statistics, so the whole
model is shared and the global model is evaluated.
"""

from .fedavg import FedAvg


class FedAvgGN(FedAvg):
    name = "fedavg-gn"
    summary = "FedAvg with GroupNorm instead of BN"
    norm = "gn"
    norms = ("gn",)
    norms_because = "is FedAvg with --norm gn; for another kind use --algo fedavg --norm KIND"


class FedAvgLN(FedAvg):
    name = "fedavg-ln"
    summary = "FedAvg with LayerNorm (GroupNorm, one group) instead of BN"
    norm = "ln"
    norms = ("ln",)
    norms_because = "is FedAvg with --norm ln; for another kind use --algo fedavg --norm KIND"
