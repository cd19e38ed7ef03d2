"""SingleSet / Standalone: every client trains alone on its own domain.

The lower reference of the papers' tables (FedBN Table 1 'SingleSet', FedWon
'Standalone'): nothing crosses the wire but the round's bookkeeping, every
model entry is private, each client starts from the same seeded initial model
as the federated methods.  Evaluates each client's own (personal) model.
"""

from .core.base import Algorithm


class SingleSet(Algorithm):
    name = "singleset"
    summary = "SingleSet: each client trains alone, nothing shared"
    evaluates = ("personal",)

    def shares(self, entry):
        return False

    def aggregate(self, server, uploads):
        """Nothing to aggregate."""
