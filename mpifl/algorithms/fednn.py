"""FedNN (Kang et al., 2024): weight normalization and adaptive group normalization.

Section 3 of the paper: every convolution is weight-normalized, eq. (4)
(``conv="wn"``, :class:`~mpifl.models.WNConv2d`), and followed by Adaptive
Group Normalization, eqs. (5)-(10) (``norm="agn"``,
:class:`~mpifl.models.AdaptiveGroupNorm`): BN and 2-group GN statistics mixed
by a Gumbel-softmax selection at temperature tau.  FedNN is a model change
put on top of an FL method (Table 2: "FedAvg+Ours", "FedProx+Ours"); its
results are those of the global model (section 4.5), so ``evaluates`` is
("global",).

Protocol, section 3 eq. (2) and the authors' public code (``myeongkyunkang/FedNN``):
the whole state is averaged with weights ``n_k / sum
n_k`` (``--uniform-weights`` for equal weights): parameters, the AGN
selection logits and BN-side running statistics included.  The choices:

* **Temperature.**  "We initially set tau to 5 and gradually decreased it to
  zero during training" (section 3.2).  The authors' code sets it at each
  round start from ``(arange(0.001, T + 1) / T)[::-1] * tau0``, i.e. for round
  r = 1..T: ``tau_r = tau0 * (T - r + 1.001) / T`` -- linear, from
  ``tau0 * (1 + 0.001/T)`` down to ``tau0 * 1.001 / T`` (never 0).
  :func:`fednn_tau` is that; ``--tau0`` (default 5, the paper's) and
  T = ``--schedule-rounds`` (default ``--rounds``, stored so that a resume with
  more rounds keeps it; tau_T beyond) fix it.  The runtime keeps one model per rank and tells the
  method the round in :meth:`begin_round`, so the temperature is put on the
  model in :meth:`begin_local`, before each client trains, and in
  :meth:`begin_eval` before an evaluation of round r's model (tau_r, the
  value the authors' averaged model carries).  Until the runtime calls
  ``begin_eval``, an evaluation uses the tau of the rank's last trained round:
  the right one whenever the rank trained a client in the evaluated round
  (always with ``--fraction 1``); otherwise scores differ slightly with the
  number of ranks.
* **Frozen choice.**  An AGN layer freezes its selection once a training draw
  is one-hot (authors' code).  The ``choice`` buffer (int64: -1 free, 0 BN,
  1 GN) is shared, but cannot be averaged: the authors' code averages a 0/1
  "fixed" flag and truncates it, so a layer is frozen in the global model only
  when every participant of the round froze it (:func:`aggregate_choice`).
  Their code then mixes with the average of the participants' one-hot draws;
  ``choice`` holds one index, so it takes the one with the larger weight
  (weighted majority), and an exact tie leaves the layer free to draw again.
  A client's own freeze is otherwise lost with the next download, as in the
  authors' code.
* **AGN mixing** (``--agn-mix``): ``var`` (default, the authors' code and
  FedNN's ablations) mixes the BN and GN variances, ``std`` the standard
  deviations of eq. (10) (:class:`~mpifl.models.AdaptiveGroupNorm`).
* **Evaluation selection** (``--agn-eval``): ``gumbel`` (default, the
  authors' code) draws Gumbel noise at every evaluation forward of a free
  layer; ``softmax`` is the noise-free ``softmax(logits / tau)``.  The draws
  come from torch's generator seeded, before each client's evaluation, from
  (seed, client, round evaluated) (``seeding.personalization_seeds``: FedNN
  has no personalization of its own), so scores do not depend on the ranks.
* **Base method.**  ``--fednn-base fedavg`` (default, "FedAvg+Ours") or
  ``fedprox`` ("FedProx+Ours"): FedProx's proximal gradient ``mu (w - w_t)``
  with FedProx's own ``--mu``, on every shared parameter.  ``--mu`` does
  nothing with the fedavg base.
* **Learning rate and clipping** (section 4.5; authors' code): the authors'
  shared training loop gives every method lr ``0.1 * 0.998^(r-1)`` and a
  gradient-norm clip of 10 after the proximal term; here both are the run's,
  for any method: ``--lr-schedule exp --lr-gamma 0.998 --max-grad-norm 10``
  (the FedNN presets set them).  The rest of the paper's setting is the
  run's too: ``--lr 0.1 --weight-decay 1e-3 --local-epochs 5 --batch-size 50
  --fraction 0.4 --rounds 200``.
"""

from __future__ import annotations

import numpy as np
import torch

from ..plan.config import Option
from ..models import set_agn_tau
from ..models.fednn import AGN_TAU0, BN, GN, AdaptiveGroupNorm
from ..plan.seeding import personalization_seeds
from .fedprox import FedProx

BASES = ("fedavg", "fedprox")
MIXES = ("var", "std")
EVAL_SELECTIONS = ("gumbel", "softmax")


def fednn_tau(tau0: float, round_index: int, rounds: int) -> float:
    """AGN temperature of round ``round_index`` (1..rounds), the authors' linear schedule."""
    return tau0 * (rounds - round_index + 1 + 0.001) / rounds


def aggregate_choice(choices, weights) -> torch.Tensor:
    """Global frozen AGN choice: -1 unless every participant froze; then the weighted majority (tie: -1)."""
    c = np.array([int(x) for x in choices])
    if len(c) == 0 or (c < 0).any():
        return torch.tensor(-1, dtype=torch.int64)
    w = np.asarray(weights, dtype=np.float64)
    bn, gn = w[c == BN].sum(), w[c == GN].sum()
    return torch.tensor(BN if bn > gn else GN if gn > bn else -1, dtype=torch.int64)


class FedNN(FedProx):
    name = "fednn"
    summary = "FedNN: weight-normalized convs, adaptive group norm (BN/GN by Gumbel-softmax), FedAvg or FedProx"
    options = FedProx.options + (
        Option("tau0", float, AGN_TAU0, "FedNN initial AGN temperature, decayed linearly to ~0 over the rounds",
               minimum=0, above=True),
        Option("fednn_base", str, "fedavg", "FedNN base method: fedavg or fedprox (then --mu applies); its lr decay "
               "and clip are the general --lr-schedule exp --lr-gamma 0.998 --max-grad-norm 10, set by the FedNN "
               "presets", choices=BASES),
        Option("agn_mix", str, "var", "FedNN AGN: mix BN/GN variances (var, authors' code) or standard "
               "deviations (std, paper eq. 10)", choices=MIXES),
        Option("agn_eval", str, "gumbel", "FedNN AGN selection at evaluation: gumbel (noisy draw, authors' code) "
               "or softmax (noise-free)", choices=EVAL_SELECTIONS),
    )
    norm = "agn"
    norms = ("agn",)
    norms_because = "is defined by its adaptive group norm layers"
    conv = "wn"

    @classmethod
    def adapt_model(cls, model, cfg):
        """Every AGN layer mixes by ``--agn-mix`` and draws evaluation noise by ``--agn-eval``."""
        mix, selection = cfg.opt("agn_mix"), cfg.opt("agn_eval")
        for layer in model.modules():
            if isinstance(layer, AdaptiveGroupNorm):
                layer.mix, layer.eval_noise = mix, selection == "gumbel"
        return model

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        self.base = cfg.opt("fednn_base")
        self.choice_keys = {e.key for e in entries if e.module_kind == "agn" and e.attr == "choice"}
        self.round = 1
        self.eval_round = 1

    def tau(self, round_index: int) -> float:
        """tau_r over the run's R = ``--schedule-rounds`` (by default ``--rounds``, kept by a resume); tau_R after."""
        horizon = self.cfg.horizon
        return fednn_tau(self.cfg.opt("tau0"), min(round_index, horizon), horizon)

    # ------------------------------------------------------------------ server
    def gathered_keys(self):
        """The AGN choices: a vote, not a sum."""
        return [k for k in self.uploaded_keys if k in self.choice_keys]

    def combine(self, key, values, weights):
        """:func:`aggregate_choice` for AGN ``choice`` (the gathered entries)."""
        return aggregate_choice(values, weights)

    # ------------------------------------------------------------------ client
    def begin_round(self, round_index):
        self.round = round_index

    def begin_eval(self, model, round_index):
        """Before evaluating round ``round_index``'s model: that round's temperature."""
        set_agn_tau(model, self.tau(round_index))
        self.eval_round = round_index

    @property
    def global_eval_per_batch(self):
        """Not under ``--agn-eval gumbel``: its draws, seeded once per client, run on through the client's batches."""
        return self.cfg.opt("agn_eval") != "gumbel"

    def global_private(self, client, download):
        """Before a client's evaluation: with ``--agn-eval gumbel``, seed the draws by (seed, client, round)."""
        if self.cfg.opt("agn_eval") == "gumbel":
            torch.manual_seed(personalization_seeds(self.cfg.seed, client.id, self.eval_round)[1])
        return super().global_private(client, download)

    def begin_local(self, client, model, download):
        set_agn_tau(model, self.tau(self.round))
        if self.base == "fedprox":
            super().begin_local(client, model, download)
        else:  # FedAvg's: no proximal anchor, only what every method holds (the guiding regularizer's head)
            self.hold_global_head(model)

    def after_backward(self, client, model):
        if self.base == "fedprox":
            super().after_backward(client, model)
