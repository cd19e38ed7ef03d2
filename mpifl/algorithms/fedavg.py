"""FedAvg (McMahan et al., 2017): local SGD, server averages the whole model.

Shares every model entry except BN ``num_batches_tracked``; BN running
statistics are averaged like weights.  Weights by training-sample count
(eq. 1 of the paper), or uniform with ``--uniform-weights`` (FedBN's code
averages Digits-Five clients uniformly).  Evaluates the global model.
"""

import numpy as np

from .core.base import Algorithm, Uploads
from .core.options import UNIFORM_WEIGHTS


class FedAvg(Algorithm):
    name = "fedavg"
    summary = "FedAvg: average the whole model, weighted by sample count"
    options = (UNIFORM_WEIGHTS,)

    def client_weights(self, uploads: Uploads) -> np.ndarray:
        if self.cfg.opt("uniform_weights"):
            return np.ones(len(uploads.clients))
        return super().client_weights(uploads)
