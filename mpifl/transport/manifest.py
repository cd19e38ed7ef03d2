"""``--show-manifest``: every tensor that crosses the wire, per direction, and its bytes per round."""

from __future__ import annotations

from .share import SharePolicy
from .wire import TensorSpec


def _table(title: str, specs: list[TensorSpec], per_round_clients: int, gathered: tuple[str, ...] = (),
           marks=None) -> list[str]:
    total = sum(s.nbytes for s in specs)
    lines = [f"{title}: {len(specs)} tensors, {total:,} bytes per client, "
             f"{total * per_round_clients:,} bytes per round ({per_round_clients} clients)"]
    width = max([len(s.name) for s in specs] + [4])
    lines += [f"  {s.name:<{width}}  {str(list(s.shape)):<18} {str(s.dtype).replace('torch.', ''):<8} {s.nbytes:>14,}"
              + ("  gathered" if s.name in gathered else "") + (f"  [{marks(s)}]" if marks else "") + _derived(s)
              for s in specs]
    return lines


def _derived(spec: TensorSpec) -> str:
    return f"  data-derived: {spec.derived}" if spec.derived else ""


def format_manifest(algo_name: str, policy: SharePolicy, clients_per_round: int,
                    setup: list[TensorSpec] = (), training_clients: int = 0, marks=None) -> str:
    """The wire manifest of an algorithm's share policy, as printed by ``--show-manifest``.

    ``setup``: one-time exchanges before training (FedRDN's statistics, a
    method's :meth:`setup_exchange`): what each of the ``training_clients``
    uploads; every client receives all of them stacked.  A tensor computed
    from the clients' data (``TensorSpec.derived``) is marked ``data-derived``
    with what it is; an upload that rank 0 receives from every client whole (``SharePolicy.gathered``)
    is marked ``gathered``.  ``marks(spec, direction)`` ("down", "up", "setup"), if given, adds to each tensor's
    line what it exposes and whether the run's privacy mechanism covers it (:mod:`mpifl.privacy.exposure`).
    """
    lines = [f"wire manifest of --algo {algo_name} (per participating client per round)"]
    for up in setup:
        n = training_clients
        lines.append(f"setup exchange, once before round 1: {n} clients each upload {up.name} "
                     f"{list(up.shape)} {str(up.dtype).replace('torch.', '')} ({up.nbytes:,} bytes); every client "
                     f"receives {up.name} {[n, *up.shape]} ({up.nbytes * n:,} bytes)"
                     + (f" [{marks(up, 'setup')}]" if marks else "") + _derived(up).replace("  ", "; ", 1))
    lines += _table("download (server -> client)", policy.download, clients_per_round,
                    marks=marks and (lambda spec: marks(spec, "down")))
    lines += _table("upload (client -> server)", policy.upload, clients_per_round, policy.gathered,
                    marks=marks and (lambda spec: marks(spec, "up")))
    gathered = [s for s in policy.upload if s.name in policy.gathered]
    lines.append(f"  of which gathered whole by rank 0 (the rest is folded into sums as it arrives): "
                 f"{len(gathered)} tensors, {sum(s.nbytes for s in gathered):,} bytes per client")
    kept = sum(s.nbytes for s in policy.private)
    lines.append(f"kept on the client, never sent: {len(policy.private)} tensors, {kept:,} bytes per client")
    lines += [f"  {s.name}" for s in policy.private]
    return "\n".join(lines)
