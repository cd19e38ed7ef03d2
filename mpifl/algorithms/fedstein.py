"""FedStein (Gupta, Jangid & Sethi, 2024): James-Stein estimates of BN statistics.

Sections 2.3, 3.2-3.3 and Algorithm 1 of the paper.  Per state entry:

* every non-BN entry (conv, linear) is averaged as in FedAvg (Algorithm 1,
  line 17);
* BN ``running_mean`` and ``running_var`` are averaged over the round's
  clients (lines 21-22), then each layer's vector is shrunk toward 0 by the
  James-Stein estimator, eq. (9) (lines 23-24):
  ``theta_JS = (1 - (c - 2) sigma^2 / ||theta||^2) theta``, ``c`` the channel
  count, by :func:`~mpifl.models.james_stein` (sigma^2 the biased variance
  across the vector's channels, factor clamped at 0, computed in float64 on
  the float64 mean; that function's docstring states why it follows eq. (9)
  as printed rather than with JSNorm's extra ``c/(c+1)``).  The shrunk
  statistics are the global ones sent down;
* BN ``weight`` and ``bias`` never leave the client (line 19, "do not
  aggregate BN parameters"; section 3.3 "keeping the learned BN parameters
  local"); ``num_batches_tracked`` stays local too (a step counter, README "How a run works").

**JSNorm in local training** (section 3.2: "the batch mean mu_B and variance
sigma_B^2 are adjusted using the James-Stein estimator"; section 2.3: "the
James-Stein estimator is utilized for both the mean and variance within the
normalization layers"; Algorithm 1, lines 26-27): the model is built with
``norm="jsbn"`` (:class:`~mpifl.models.jsbn.JSBatchNorm2d`), which normalizes
with eq. (9) applied to the mini-batch's mean and biased variance in
training; its running statistics track the plain batch statistics, which are
what lines 21-22 average and lines 23-24 shrink.  At inference a layer
normalizes with the shrunk global statistics of the download.  Training with
ordinary BN instead and only inferring with shrunk statistics collapses the
running means toward 0 (the factor is about 2/c for means centred near 0):
on styledigits with SmallCNN, 8 rounds, lr 0.05, personal test accuracy was
14 % that way against 51 % with JSNorm (FedBN: 49 %).

Where the paper is silent or ambiguous (FedStein has no public code):

* **Weights.**  Algorithm 1 writes a plain ``1/K`` mean; the text says
  FedStein "adheres to the FedAvg protocols for server aggregation".  As the
  other methods here: sample-count weights, ``--uniform-weights`` for
  Algorithm 1's ``1/K`` (the two agree on FedBN's equal-size Digits-Five
  partitions that the paper uses).  The same weights average the statistics.
* **JS of batch statistics** uses the same eq. (9) and sigma^2 rule as the
  server (float32, in the graph); vectors of at most 2 channels are left as
  they are, as :func:`~mpifl.models.james_stein` does.
* **What is evaluated.**  Section 4.3: "client local models to evaluate the
  seen domains, while the server global model was applied to test the unseen
  domain".  So every training client is evaluated with its *personal* model
  (shared entries + its own BN affine); with ``--holdout`` the *global* model,
  the one the server holds, is evaluated too, on every client and the
  held-out domain (listed first then, as gPerXAN does, so the fold table
  finds it).  The server never receives BN affine parameters, so its model
  keeps them at their initial values (weight 1, bias 0), as the server model
  of FedBN's code, on which FedStein's Digits-Five setup is built, does for
  every entry it does not aggregate.
"""

from __future__ import annotations

import torch

from ..models import james_stein
from .fedavg import FedAvg

BN_RUNNING_STATS = ("running_mean", "running_var")


class FedStein(FedAvg):
    name = "fedstein"
    summary = "FedStein: JSNorm layers, James-Stein-shrunk mean BN statistics, BN affine local, rest averaged"
    norm = "jsbn"
    evaluates = ("personal",)

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        if cfg.holdout is not None:
            self.evaluates = ("global", "personal")
        self.stat_keys = {e.key for e in entries if e.module_kind == "bn" and e.attr in BN_RUNNING_STATS}
        self.affine_keys = [e.key for e in entries if e.module_kind == "bn" and e.is_param]
        self._server_affine: dict[str, torch.Tensor] = {}  # the global model's BN affine: its initial values
        self._affine_on: dict[torch.device, dict[str, torch.Tensor]] = {}

    def shares(self, entry):
        """All but BN weight, bias and step counter (running statistics do cross)."""
        if entry.module_kind == "bn":
            return entry.attr in BN_RUNNING_STATS
        return super().shares(entry)

    def combine(self, key, values, weights):
        """Weighted mean of every shared entry; then eq. (9) on each BN running statistic."""
        mean = super().combine(key, values, weights)
        return james_stein(mean) if key in self.stat_keys else mean

    def init_client(self, spec, initial):
        if not self._server_affine:
            self._server_affine = {k: initial[k].clone() for k in self.affine_keys}
        return super().init_client(spec, initial)

    def global_private(self, client, download):
        """The server's model: the client's step counters, but the initial (never aggregated) BN affine."""
        out = dict(client.private)
        if self.affine_keys:
            device = client.private[self.affine_keys[0]].device
            if device not in self._affine_on:
                self._affine_on[device] = {k: v.to(device) for k, v in self._server_affine.items()}
            out.update(self._affine_on[device])
        return out
