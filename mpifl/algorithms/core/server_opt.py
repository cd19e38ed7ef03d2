"""The server step of the methods that treat the clients' averaged update as a pseudo-gradient.

Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar & McMahan, "Adaptive Federated Optimization", ICLR 2021,
Algorithm 1: the server applies an optimizer to

    Delta_t = sum_S w_i y_i - x_t

(x_t the global model, y_i the clients' trained models, w_i FedAvg's weights; the paper's mean of y_i - x_t).
:class:`ServerOptimizer` is that step for every trainable parameter, :meth:`ServerOptimizer.server_step` its
rule.  The rule's state (``ServerState.extra``, ``<method>.<slot>/<key>``) stays on the server and never
travels: the wire is FedAvg's.  BN running statistics are averaged as in FedAvg (a step on them could push a
running variance below zero); ``num_batches_tracked`` stays local.

Members: FedAvg with a server learning rate and SCAFFOLD's global step (the default rule), FedAvgM,
FedAdagrad, FedAdam and FedYogi (:class:`AdaptiveServerOptimizer`).  FedDyn's step is not one: it reads a
second reduction (sum_P theta_k / m) and returns ``mean - h / alpha``, which written as ``x + step`` would
round differently.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import Algorithm
from .deltas import trainable_keys


class ServerOptimizer(Algorithm):
    """Put before FedAvg in a method's bases: ``x <- server_step(x, mean, state)`` on trainable parameters."""

    slots: ClassVar[tuple[str, ...]] = ()  # the rule's server state, one tensor per trainable parameter each

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        self.params = trainable_keys(self)

    def slot(self, name: str, key: str) -> str:
        return f"{self.name}.{name}/{key}"

    def initial_slot(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A state tensor's value before the first round (zero), shaped as the parameter ``value``."""
        return torch.zeros_like(value)

    def init_server(self, initial):
        server = super().init_server(initial)
        server.extra = {self.slot(s, k): self.initial_slot(s, initial[k]) for s in self.slots for k in self.params}
        return server

    def global_value(self, server, key, combined, uploads):
        if key not in self.params:
            return combined
        dtype = server.model[key].dtype
        state = {s: server.extra[self.slot(s, key)].double() for s in self.slots}
        value = self.server_step(server.model[key].double(), combined, state)
        server.extra.update({self.slot(s, key): state[s].to(dtype) for s in self.slots})
        return value

    def server_step(self, x: torch.Tensor, combined: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """The new global value from x and the clients' mean (Delta = combined - x), float64; the rule sets its
        new ``state``.  Server SGD, Reddi et al.'s FedAvg with server learning rate eta = ``--server-lr``:
        ``x + eta Delta``; at eta = 1 the mean itself (FedAvg's bits)."""
        eta = self.cfg.opt("server_lr")
        return combined if eta == 1 else x + eta * (combined - x)


class AdaptiveServerOptimizer(ServerOptimizer):
    """Reddi et al.'s Algorithm 2 (FedAdagrad, FedYogi, FedAdam)::

        m_t = beta1 m_{t-1} + (1 - beta1) Delta_t,   v_t = second_moment(v_{t-1}, Delta_t^2),
        x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

    from m_{-1} = 0 and v_{-1} = tau^2 (Algorithm 2 asks v_{-1} >= tau^2: its least value), without bias
    correction, as the paper writes it.  (The authors' code, google-research/federated ``optimization``, runs
    Keras' optimizers instead: Adagrad and Yogi accumulators from 0, Adam bias-corrected.)  beta1 = ``--beta1``
    (0.9, Keras' default, which the authors keep), beta2 = ``--beta2`` (0.99, Flower's default; the authors keep
    Keras' 0.999), tau = ``--tau`` (1e-3, the authors' recommended start; their best per task: 1e-5 to 1e-1).
    eta = ``--server-lr`` and the clients' ``--lr`` are tuned per task there; each member states its default."""

    slots = ("m", "v")

    def initial_slot(self, name, value):
        return torch.full_like(value, self.cfg.opt("tau") ** 2) if name == "v" else torch.zeros_like(value)

    def server_step(self, x, combined, state):
        beta1, tau, eta = self.cfg.opt("beta1"), self.cfg.opt("tau"), self.cfg.opt("server_lr")
        delta = combined - x
        state["m"] = beta1 * state["m"] + (1 - beta1) * delta
        state["v"] = self.second_moment(state["v"], delta * delta)
        return x + eta * state["m"] / (state["v"].sqrt() + tau)

    def second_moment(self, v: torch.Tensor, squared: torch.Tensor) -> torch.Tensor:
        """v_t from v_{t-1} and Delta_t^2: the member's rule."""
        raise NotImplementedError
