"""FedBN (Li et al., ICLR 2021): batch normalization stays local.

Every BN entry (affine weight and bias, running mean and variance, step
counter) is private to its client; every other entry is averaged as in
FedAvg (Algorithm 1 of the paper).  Each client is evaluated with its
personal model: the shared layers plus its own BN layers.  FedBN's code
weights clients uniformly on Digits-Five; here the weights follow FedAvg
(sample count) unless ``--uniform-weights``.

With ``--norm perxan``, ``ibn`` or ``dson`` the BN side of each composite
layer stays local (PerXAN's BN side, IBN-a's BN half, a DSON layer whole:
DSON's domain-specific normalization with one domain per client) and the IN
side is averaged; kinds without BN entries are refused.
"""

from .fedavg import FedAvg


class FedBN(FedAvg):
    name = "fedbn"
    summary = "FedBN: BN layers (affine and statistics) stay on each client, the rest is averaged"
    evaluates = ("personal",)
    norms = ("bn", "jsbn", "perxan", "ibn", "dson")
    norms_because = "keeps BN layers (and the BN sides of composite norms) on each client, which other kinds lack"

    def shares(self, entry):
        return not (entry.module_kind == "bn" or entry.is_bn_side)
