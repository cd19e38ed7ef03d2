"""FixBN (Zhong et al., 2023, "Making Batch Normalization Great in Federated Deep Learning").

Two stages:

1. **Exploration** (rounds 1..T, ``--fixbn-stage-rounds T``): FedAvg with
   BN; running statistics are averaged with the weights.
2. **Calibration** (rounds > T): the BN statistics are frozen at the global
   values aggregated after round T.  Local training normalizes with them
   (BN layers in evaluation mode while the rest trains, so the statistics
   neither follow mini-batches nor change) and the BN affine parameters keep
   training and being averaged.

Wire: in round T+1 the frozen statistics go down one last time and are not
sent back; every client adopts them as its own (``Algorithm.sends_back``),
and from round T+2 on they are not sent at all.  Default T = half of the
run's R (``--schedule-rounds``, by default ``--rounds``; stored in config.json,
so a run resumed with more ``--rounds`` keeps its T).  The paper switches
midway through training; it sets T from a schedule of its own.  With T >= rounds FixBN is FedAvg.  Evaluates the
global model.

``--norm``: the BatchNorm modules inside PerXAN and IBN layers freeze as
plain ones do; DSON (batch statistics mixed inside one layer) and kinds
without running statistics are refused.
"""

from torch.nn.modules.batchnorm import _BatchNorm

from ..plan.config import Option
from .fedavg import FedAvg


class FixBN(FedAvg):
    name = "fixbn"
    summary = "FixBN: FedAvg, then BN statistics frozen at their global values and no longer sent"
    options = FedAvg.options + (Option("fixbn_stage_rounds", int, None, "rounds of the first stage before BN "
                                       "statistics freeze (default --schedule-rounds/2)", minimum=1),)
    norms = ("bn", "jsbn", "perxan", "ibn")
    norms_because = "freezes the running statistics of BatchNorm modules, which other kinds lack or mix in"

    @property
    def stage_rounds(self) -> int:
        value = self.cfg.opt("fixbn_stage_rounds")
        return self.cfg.horizon // 2 if value is None else value

    def phase_of(self, round_index):
        """0: exploration; 1: the round that delivers the frozen statistics; 2: calibration."""
        return min(max(round_index - self.stage_rounds, 0), 2)

    def shares(self, entry):
        if entry.is_bn_stat and entry.attr != "num_batches_tracked":
            return self.phase <= 1
        return super().shares(entry)

    def sends_back(self, entry):
        return not (entry.is_bn_stat and self.phase >= 1)

    @property
    def global_model_shared(self):
        """One model for every client: from the second stage its private BN statistics are the frozen global ones,
        which every client adopts and none changes (its BN layers train in evaluation mode)."""
        return True

    def train_mode(self, model):
        model.train()
        if self.phase >= 1:
            for module in model.modules():
                if isinstance(module, _BatchNorm):
                    module.eval()
