"""FedDG-GA (Zhang, Xu, Yao, Zhang, Tian & Wang, "Federated Domain Generalization with Generalization
Adjustment", CVPR 2023).

FedAvg whose aggregation weights a_i (one per training client, summing to 1) move every round with the
clients' *generalization gaps*:

* **Gap** of client i for round q: G_i = S_i(theta^q) - S_i(theta_i^q), theta_i^q the client's model after
  local training in round q, theta^q the global model aggregated from them, S_i a score on the client's
  validation split where larger is worse: the mean cross-entropy (``--ga-metric loss``, the paper's
  definition) or the error rate (``acc``, the default of every ``*_GA.py`` script of the authors' code,
  ``--fair acc``: their gap is acc(theta_i^q) - acc(theta^q), the same thing in accuracy).
* **Adjustment**: a_i <- a_i + s_q g_i / max_j |g_j|; then every a_i is clipped to [0, 1] and the vector
  renormalised to sum 1 (the code's ``weight_clip``).  What g is and the step s_q (``--ga-rule``, d =
  ``--ga-step``, R = ``--schedule-rounds``, N training clients):

  - ``code`` (default, the authors' code, ``MediaBrain-SJTU/FedDG-GA``: ``utils/weight_adjust.py`` and the
    ``algorithms/*/train_pacs_GA.py`` scripts): g_i = G_i, the gaps as they are (not centred);
    s_q = d (1 - (q - 2)/R) / N (their step ``step_size - (i - 1) step_size / comm`` after 0-based round
    i = q - 1, divided by 3, which is 1/N for their three source domains, also their initial weight);
  - ``paper`` (the paper's equations as summarised for this implementation: gaps centred on their mean,
    d^r = (1 - r/R) d; its text was not at hand to check the round index or a 1/N factor):
    g_i = G_i - mean_j G_j; s_q = d (1 - q/R) / N (1/N kept so that d means the same in both rules).

  s_q is clamped at 0 after R rounds (a resumed run with more ``--rounds`` keeps R: ``--schedule-rounds``).
  Where every g_j is 0 (all gaps equal under ``paper``, all zero under ``code``) the weights stay as they are
  (the code would divide by zero).  ``--ga-step`` 0.2 is the code's ``--step_size`` default.
* **Start**: a_i = 1/N (the code's 1/3 for three domains, not sample counts).
* **Order**: the weights adjusted with round q's gaps aggregate round q + 1, as in the code, where a round
  trains, aggregates with the current weights, scores the new global model and then adjusts.  Here the
  scores travel on the wire: in each round a client uploads ``feddg_ga.scores`` = (S_i of the model it
  downloaded, S_i of its trained model), two float64 scalars computed from its validation data.  The
  server keeps each client's last trained-model score and the round it came from (``ServerState.extra``,
  checkpointed with the weights), so at round q + 1 the download's score S_i(theta^q) meets the kept
  S_i(theta_i^q): round 1 adjusts nothing and the first adjustment acts on round 2's aggregation.

**Partial participation** (not in the paper or code, which train all clients every round): a client has a
gap at round q + 1 only if it also trained in round q (the two scores are then of the same round, the
definition); only those clients' a_i move, then all are clipped and renormalised together.  The
round's model is the weighted mean over its participants with their a_i (renormalised over them); if they
all weigh 0 the global model stays as it is.  Evaluates the global model.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import MpiflError
from ..plan.config import Option
from ..transport.wire import TensorSpec
from .core.base import Algorithm

SCORES = "feddg_ga.scores"  # uploaded: (score of the downloaded model, score of the trained model)
WEIGHTS = "feddg_ga.weights"  # server: a_i by client id (0 for a held-out domain)
LAST_SCORE = "feddg_ga.last_score"  # server: each client's last trained-model score
SCORED_IN = "feddg_ga.scored_in"  # server: the round it came from (-1: none yet)
RULES = ("code", "paper")
METRICS = ("acc", "loss")


def generalization_gaps(global_scores: np.ndarray, local_scores: np.ndarray, metric: str) -> np.ndarray:
    """G_i, larger = the global model serves client i worse than its own: loss(global) - loss(local), or
    acc(local) - acc(global)."""
    return global_scores - local_scores if metric == "loss" else local_scores - global_scores


def adjust_weights(weights: np.ndarray, who: np.ndarray, gaps: np.ndarray, step: float,
                   centre: bool) -> np.ndarray:
    """a_who += step g / max|g| (g the gaps, centred on their mean with ``centre``), then a clipped to [0, 1]
    and renormalised to sum 1; ``weights`` unchanged where every g is 0 or the step is 0."""
    g = gaps
    if centre and len(gaps):  # equal gaps centre to exact zeros, not to the rounding error of their mean
        g = np.zeros_like(gaps) if np.ptp(gaps) == 0 else gaps - gaps.mean()
    largest = float(np.abs(g).max()) if len(g) else 0.0
    if largest == 0.0 or step == 0.0:
        return weights
    moved = weights.copy()
    moved[who] += step * g / largest
    moved = np.clip(moved, 0.0, 1.0)
    total = moved.sum()
    if total <= 0.0:
        raise MpiflError(f"--ga-step: a step of {step:g} clipped every FedDG-GA weight to 0; use a smaller --ga-step")
    return moved / total


class FedDGGA(Algorithm):
    name = "feddg-ga"
    summary = "FedDG-GA: FedAvg whose client weights move each round with the clients' generalization gaps"
    reductions_need_results = True  # the weights move with the round's gathered scores (prepare)
    options = (
        Option("ga_step", float, 0.2, "FedDG-GA step size d of the weight adjustment (decays linearly over "
               "--schedule-rounds)", minimum=0),
        Option("ga_metric", str, "acc", "FedDG-GA gap score on the client's val split: acc (authors' code "
               "default) or loss (the paper's)", choices=METRICS),
        Option("ga_rule", str, "code", "FedDG-GA rule: code (gaps not centred, step d (1 - (q - 2)/R)/N) or "
               "paper (gaps centred on their mean, step d (1 - q/R)/N)", choices=RULES),
    )

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        self.metric = cfg.opt("ga_metric")
        self.paper = cfg.opt("ga_rule") == "paper"
        self.num_clients = 0
        self.round = 0
        self._scores: dict[str, float] = {}
        self._weights: np.ndarray | None = None

    def bind_clients(self, clients):
        super().bind_clients(clients)
        self.num_clients = len(clients)
        for c in clients:
            if c.trains and not len(c.rows["val"]):
                raise MpiflError(f"feddg-ga scores each client on its validation split and client {c.id} "
                                 f"({c.domain}) has none; use fewer --clients-per-domain")

    def begin_round(self, round_index):
        self.round = round_index

    def step(self, gap_round: int) -> float:
        """s_q for the gaps of round q: d (1 - (q - 2)/R)/N (code) or d (1 - q/R)/N (paper), at least 0."""
        offset = 0 if self.paper else 2
        decay = max(0.0, 1.0 - (gap_round - offset) / self.cfg.horizon)
        return self.cfg.opt("ga_step") * decay / self.num_training_clients

    # ------------------------------------------------------------------ wire
    def extra_upload(self):
        what = "accuracy" if self.metric == "acc" else "mean cross-entropy"
        return [TensorSpec(SCORES, (2,), torch.float64,
                           derived=f"the client's validation {what} of the downloaded and of its trained model",
                           exposes="scores")]

    # ---------------------------------------------------------------- client
    def score_local(self, client, model, moment, score):
        loss_sum, correct, count = score("val")
        self._scores[moment] = (correct if self.metric == "acc" else loss_sum) / count

    def end_local(self, client, model):
        return {SCORES: torch.tensor([self._scores["downloaded"], self._scores["trained"]], dtype=torch.float64)}

    # ---------------------------------------------------------------- server
    def init_server(self, initial):
        server = super().init_server(initial)
        weights = torch.zeros(self.num_clients, dtype=torch.float64)
        weights[self.training_ids] = 1.0 / len(self.training_ids)
        server.extra = {WEIGHTS: weights,
                        LAST_SCORE: torch.zeros(self.num_clients, dtype=torch.float64),
                        SCORED_IN: torch.full((self.num_clients,), -1, dtype=torch.int64)}
        return server

    def gathered_keys(self):
        return [SCORES]

    def prepare(self, server, uploads):
        """Adjust a with the gaps of round r - 1 and keep this round's trained-model scores."""
        ids = uploads.clients
        scores = np.stack(uploads.tensors[SCORES]).astype(np.float64)
        last, scored_in = server.extra[LAST_SCORE].numpy(), server.extra[SCORED_IN].numpy()
        fresh = scored_in[ids] == self.round - 1
        gaps = generalization_gaps(scores[fresh, 0], last[ids[fresh]], self.metric)
        self._weights = adjust_weights(server.extra[WEIGHTS].numpy(), ids[fresh], gaps, self.step(self.round - 1),
                                       self.paper)
        server.extra[WEIGHTS] = torch.from_numpy(np.array(self._weights))
        last[ids], scored_in[ids] = scores[:, 1], self.round

    def averages(self, uploads) -> bool:
        """Whether the round's participants have weight left to average with (else the model stays)."""
        return self._weights[uploads.clients].sum() > 0

    def reductions(self, server, uploads):
        return super().reductions(server, uploads) if self.averages(uploads) else {}

    def aggregate(self, server, uploads):
        """The a-weighted means of :meth:`prepare`'s weights."""
        if self.averages(uploads):
            super().aggregate(server, uploads)

    def client_weights(self, uploads):
        """a_i of the round's participants (the weighted mean renormalises them)."""
        return self._weights[uploads.clients]
