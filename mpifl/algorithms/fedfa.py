"""FedFA (Zhou & Konukoglu, "FedFA: Federated Feature Augmentation", ICLR 2023).

FedAvg whose network carries feature-augmentation (FFA) layers
(:class:`~mpifl.models.fedfa.FeatureAugmentation`, whose docstring gives the
layer's equations): in local training each FFA layer, with probability p,
replaces the instance statistics (mean, std) of its input map by Gaussian
samples around them, with a variance built from the client's mini-batch
(*client-specific*) and from the spread of all clients' statistics
(*client-sharing*, computed by the server).  Algorithm 1 of the paper:

* **Client**: training updates each FFA layer's momentum statistics
  ``(mu_bar, sigma_bar)``; afterwards they are uploaded as ``fedfa.stats/<i>``
  (2 x C_i: mu_bar, sigma_bar) for FFA layer i.  Where a round starts them
  (``--fedfa-stats``): ``carry`` (default, the authors' code,
  ``tfzhou/FedFA``, whose statistics are model buffers averaged by the
  server and loaded with the model) from the server's weighted mean of the
  last uploads (FedAvg's weights; (0, 1) before any), sent down as
  ``fedfa.running/<i>`` (2 x C_i); ``reset``: from (0, 1) every round, the
  paper's Algorithm 1, line 5 (nothing extra sent down).
* **Server**: the model is averaged as in FedAvg (every entry but BN step
  counters, sample-count weights or ``--uniform-weights``; the authors'
  code averages the whole state).  The variance over the round's
  participants of their ``mu_bar`` and of their ``sigma_bar`` (unweighted,
  in float64, client order) gives the client-sharing statistic variances
  (line 13), sent down in the FFA layers' buffers
  ``fedfa.<i>.shared_var_mean`` / ``shared_var_std``: model entries sent
  down but not back (``sends_back``), initially 1.  The adaptive fusion
  coefficients (line 15) are computed from them in the layer.  Which
  variance (``--fedfa-var``): ``layer`` (default, the authors' code,
  ``pyfed/manager/comm.py``: ``torch.var`` of the stacked K x C statistics,
  one unbiased variance over all clients and channels, 1/(KC - 1), written
  into every channel, so every fusion coefficient is 1 and only the
  variance's size matters); ``channel``: per channel over the clients,
  1/K, the paper's line 13 (the coefficients then differ by channel).
* **Evaluation**: the global model (the FFA layers are the identity in
  evaluation).

**Positions** (:func:`~mpifl.models.surgery.stage_outputs`): after every
stage of the feature extractor, as the authors' AlexNet, which has an FFA
layer after each of its five conv blocks (after the pool where a block has
one).  ResNets: after each residual stage; SmallCNN/DigitModel/LeNet: after
each conv block's norm (their ReLU and pooling are functional).  Inserted by
forward hooks (:func:`~mpifl.models.surgery.insert_after`), so the model's
own state-dict keys are unchanged; the FFA layers add ``fedfa.<i>.*``.

Hyperparameters: ``--fedfa-p`` 0.5 and ``--fedfa-momentum`` 0.99, the
authors' ``FFALayer`` defaults.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from ..plan.config import Option
from ..errors import MpiflError
from ..models.fedfa import FEDFA_MOMENTUM, FEDFA_P, FeatureAugmentation
from ..models.surgery import insert_after, stage_outputs
from ..transport.wire import TensorSpec
from .fedavg import FedAvg

ATTR = "fedfa"
_SHARED = re.compile(rf"^{ATTR}\.(\d+)\.shared_var_(mean|std)$")


STATS_RULES = ("carry", "reset")
VARIANCE_RULES = ("layer", "channel")


def shared_variance(stats: np.ndarray, rule: str) -> np.ndarray:
    """(2, C) variances of the clients' (K, 2, C) statistics: per channel (1/K), or one unbiased value per
    statistic over clients and channels (1/(KC - 1), as ``torch.var`` of the stack) in every channel."""
    if rule == "channel":
        return stats.var(axis=0)
    flat = stats.transpose(1, 0, 2).reshape(stats.shape[1], -1)
    return np.repeat(flat.var(axis=1, ddof=1)[:, None], stats.shape[2], axis=1)


def stats_name(layer: int) -> str:
    return f"fedfa.stats/{layer}"


def running_name(layer: int) -> str:
    return f"fedfa.running/{layer}"


class FedFA(FedAvg):
    name = "fedfa"
    summary = "FedFA: FedAvg with feature-statistics augmentation layers, variances shared through the server"
    options = FedAvg.options + (
        Option("fedfa_p", float, FEDFA_P, "FedFA: probability an FFA layer augments a mini-batch",
               minimum=0, maximum=1),
        Option("fedfa_momentum", float, FEDFA_MOMENTUM, "FedFA: momentum of the clients' running statistics",
               minimum=0, maximum=1, below=True),
        Option("fedfa_stats", str, "carry", "FedFA: clients' running statistics at a round start: carry (the "
               "server's average, authors' code) or reset to (0, 1) (paper Alg. 1)", choices=STATS_RULES),
        Option("fedfa_var", str, "layer", "FedFA: the server's variance of client statistics: layer (one value "
               "over clients and channels, authors' code: every fusion coefficient is 1) or channel (per channel, "
               "paper Alg. 1 line 13)", choices=VARIANCE_RULES),
    )

    @classmethod
    def adapt_model(cls, model, cfg):
        p, momentum = cfg.opt("fedfa_p"), cfg.opt("fedfa_momentum")
        insert_after(model, stage_outputs(model),
                     lambda channels: FeatureAugmentation(channels, p=p, momentum=momentum), ATTR)
        return model

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        self.shared_vars: dict[int, dict[str, str]] = {}  # layer -> {"mean"|"std": model key}
        self.channels: dict[int, int] = {}
        for entry in entries:
            match = _SHARED.match(entry.key)
            if match:
                layer = int(match.group(1))
                self.shared_vars.setdefault(layer, {})[match.group(2)] = entry.key
                self.channels[layer] = entry.shape[0]
        if not self.shared_vars:
            raise MpiflError("fedfa: the model has no FFA layers (build it with FedFA.adapt_model)")
        self.carry = cfg.opt("fedfa_stats") == "carry"
        self.variance_rule = cfg.opt("fedfa_var")

    def sends_back(self, entry):
        return not _SHARED.match(entry.key)

    def derived_from_data(self, entry):
        if _SHARED.match(entry.key):
            return "variance over clients of their feature statistics"
        return super().derived_from_data(entry)

    def extra_upload(self):
        return [TensorSpec(stats_name(i), (2, c), torch.float32,
                           derived="running mean and std of the client's feature maps", exposes="data statistics")
                for i, c in sorted(self.channels.items())]

    def extra_download(self):
        if not self.carry:
            return []
        return [TensorSpec(running_name(i), (2, c), torch.float32, derived="clients' feature statistics, averaged",
                           exposes="data statistics")
                for i, c in sorted(self.channels.items())]

    # ------------------------------------------------------------------ server
    def init_server(self, initial):
        server = super().init_server(initial)
        server.extra = {s.name: torch.stack([torch.zeros(s.shape[1]), torch.ones(s.shape[1])])
                        for s in self.extra_download()}
        return server

    def download(self, server):
        return {**super().download(server), **server.extra}

    def gathered_keys(self):
        """Every client's feature statistics: their variance across clients is the shared one."""
        return [stats_name(i) for i in sorted(self.channels)]

    def aggregate(self, server, uploads):
        super().aggregate(server, uploads)
        weights = self.client_weights(uploads)
        for layer, keys in self.shared_vars.items():
            if self.carry:
                server.extra[running_name(layer)] = self.combine(
                    running_name(layer), uploads.tensors[stats_name(layer)], weights).float()
            stats = np.stack(uploads.tensors[stats_name(layer)]).astype(np.float64)  # (K, 2, C)
            var = shared_variance(stats, self.variance_rule)
            for row, kind in enumerate(("mean", "std")):
                key = keys[kind]
                server.model[key] = torch.from_numpy(var[row]).to(server.model[key].dtype)

    # ------------------------------------------------------------------ client
    @staticmethod
    def ffa_layers(model) -> list[FeatureAugmentation]:
        return list(getattr(model, ATTR))

    def begin_local(self, client, model, download):
        super().begin_local(client, model, download)
        for i, layer in enumerate(self.ffa_layers(model)):
            if self.carry:
                layer.load_running(download[running_name(i)])
            else:
                layer.reset_running()

    def end_local(self, client, model):
        return {stats_name(i): layer.client_stats() for i, layer in enumerate(self.ffa_layers(model))}
