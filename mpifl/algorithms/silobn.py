"""SiloBN (Andreux et al., 2020): BN statistics local, BN affine parameters shared.

Running means and variances (and the step counter) of every BN layer stay
on the client; BN weight and bias are averaged with all other parameters.
Evaluated with each client's personal model (shared parameters + its own
statistics), the paper's 'local statistics' evaluation.  With ``--norm
perxan``, ``ibn`` or ``dson`` the running statistics of their BN sides stay
local; kinds without running statistics are refused.
"""

from .fedavg import FedAvg


class SiloBN(FedAvg):
    name = "silobn"
    summary = "SiloBN: BN running statistics stay on each client, BN affine parameters are averaged"
    evaluates = ("personal",)
    norms = ("bn", "jsbn", "perxan", "ibn", "dson")
    norms_because = "keeps BN running statistics on each client, which other kinds lack"

    def shares(self, entry):
        return not entry.is_bn_stat
