"""Privacy mechanisms around a method's uploads (docs/privacy.md): client-level differential privacy, record-level
DP-SGD inside each client, and secure aggregation; the accountant they report their guarantees with comes from
Opacus (``pip install -e ".[privacy]"``)."""

from __future__ import annotations

from ..algorithms import Algorithm
from ..plan.config import RunConfig
from ..transport.wire import TensorSpec
from .client_dp import ClientLevelDP, resolve_noise
from .mechanism import Privacy


def privacy_of(cfg: RunConfig, algo: Algorithm, exchanges: list[TensorSpec | None]) -> Privacy:
    """The run's mechanism, the same on every rank (``exchanges``: the one-time exchanges' specs, a refusal's
    reason); what its options leave open is filled into ``cfg`` first (:func:`.client_dp.resolve_noise`)."""
    if not cfg.dp_clip:
        return Privacy()
    resolve_noise(cfg, len(algo.training_ids))
    return ClientLevelDP(cfg, algo, len(algo.training_ids), exchanges)
