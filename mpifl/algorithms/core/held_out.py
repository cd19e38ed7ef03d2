"""Personal entries averaged for the held-out domain's global model only (leave-one-domain-out).

A method whose personal layers the server never receives has no trained
value for them in its global model.  With ``--holdout``, a method that mixes
in :class:`HeldOutAverage` has every round's clients also upload the entries
:meth:`~HeldOutAverage.averaged_for_held_out` selects; the server takes their
weighted mean (the method's ``client_weights``) and sends it down under
``<method>.global_bn/<key>``, used *only* by ``global_private`` to assemble
the global model that evaluates the held-out domain (and the source
domains' "global" rows).  Training clients never load it, and without
``--holdout`` nothing extra crosses the wire.
"""

from __future__ import annotations

import torch

from .reduction import Reduction, mean_weights


class HeldOutAverage:
    """Mixin over an :class:`~mpifl.algorithms.core.base.Algorithm`; see the module docstring."""

    def averaged_for_held_out(self, entry) -> bool:
        """Whether a (private) model entry is averaged for the held-out domain's global model."""
        raise NotImplementedError

    def __init__(self, cfg, entries):
        super().__init__(cfg, entries)
        self._up, self._down = f"{self.name}.bn/", f"{self.name}.global_bn/"
        chosen = [e for e in entries if self.averaged_for_held_out(e)] if cfg.holdout is not None else []
        self._held_out = chosen

    def extra_upload(self):
        return super().extra_upload() + [self.entry_spec(e, self._up + e.key) for e in self._held_out]

    def extra_download(self):
        return super().extra_download() + [self.entry_spec(e, self._down + e.key) for e in self._held_out]

    def init_server(self, initial):
        server = super().init_server(initial)
        server.extra.update({self._down + e.key: initial[e.key].clone() for e in self._held_out})
        return server

    def download(self, server):
        return {**super().download(server), **{self._down + e.key: server.extra[self._down + e.key]
                                              for e in self._held_out}}

    def reductions(self, server, uploads):
        """The method's sums, and the weighted mean of each entry averaged for the held-out domain."""
        p = mean_weights(self.client_weights(uploads))
        return {**super().reductions(server, uploads),
                **{self._down + e.key: Reduction(self._up + e.key, p) for e in self._held_out}}

    def aggregate(self, server, uploads):
        super().aggregate(server, uploads)
        for e in self._held_out:
            server.extra[self._down + e.key] = torch.from_numpy(uploads.sums[self._down + e.key]).to(e.dtype)

    def end_local(self, client, model):
        state = model.state_dict()
        return {**super().end_local(client, model), **{self._up + e.key: state[e.key] for e in self._held_out}}

    @property
    def global_model_shared(self):
        """One model for every client when each private entry but the step counters is averaged for it."""
        averaged = {e.key for e in self._held_out}
        return super().global_model_shared or all(key in averaged or key.endswith("num_batches_tracked")
                                                  for key in self.private_keys)

    def global_private(self, client, download):
        """The client's unshared entries with the averaged ones in place of its own."""
        return {**super().global_private(client, download),
                **{e.key: download[self._down + e.key] for e in self._held_out}}
