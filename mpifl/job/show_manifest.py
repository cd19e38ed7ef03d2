"""``--show-manifest``: what a run would send, printed instead of running it."""

from __future__ import annotations

import dataclasses

from ..data import ensure_dataset
from ..plan.config import RunConfig
from ..plan.optim import KEPT
from ..privacy.exposure import marks
from ..session.session import make_session, read_labels
from ..transport.manifest import format_manifest


def manifest_text(cfg: RunConfig) -> str:
    """``--show-manifest``: the clients, and every tensor that crosses the wire, one-time exchanges included;
    under ``--holdout all`` each fold's in turn."""
    manifest = ensure_dataset(cfg.data_root, cfg.data)
    if cfg.holdout == "all":
        return "\n".join(f"fold holdout-{domain} (--holdout {domain}):\n"
                         + manifest_text(dataclasses.replace(cfg, holdout=domain)) for domain in manifest.domains)
    session = make_session(cfg, manifest, num_hosts=1, labels=read_labels(cfg, manifest))
    domains = session.manifest.domains
    setup = [spec for spec in (e.setup_exchange() for e in session.exchanges) if spec is not None]
    kept = (f"\n  {KEPT}<parameter>/<name>: with --keep-optimizer, the local {cfg.optimizer} optimizer's state of "
            "every parameter it has stepped (SGD: momentum_buffer; Adam: exp_avg, exp_avg_sq, step)"
            if cfg.keep_optimizer else "")
    kept += ("\n  dpsgd/history: with --dpsgd-clip, the client's RDP accountant history, rows of (noise multiplier, "
             "sampling rate, steps), float64 (mpifl.privacy.dp_sgd)" if cfg.dpsgd_clip else "")
    per_round = (f"each taking part with probability {cfg.fraction:g} (Poisson), {len(session.sampled(1))} in round 1"
                 if cfg.dp_clip else f"{len(session.sampled(1))} per round")
    return (f"clients: {len(session.clients)} over {len(domains)} domains, {per_round}\n"
            + format_manifest(cfg.algo, session.policy(), len(session.sampled(1)), setup,
                              len(session.training_ids), marks(session.privacy)) + kept
            + (f"\n{session.secure.describe()}, one tensor per weighted sum" if session.secure else ""))
