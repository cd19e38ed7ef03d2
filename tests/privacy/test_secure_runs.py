"""Secure aggregation in a whole run: what rank 0 receives (the same bits on any rank count and after a resume:
``test_rank_counts.py``, with every mechanism at once)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mpifl.algorithms.core.reduction import weighted_sum
from mpifl.privacy import secure as secure_module
from mpifl.server import folding as folding_module

from ..conftest import run_here

pytestmark = pytest.mark.slow


def _args(data_root, out, *extra, secure=True):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--out", str(out), "--lr", "0.05", "--momentum",
            "0.9", "--threads", "1", "--clients-per-domain", "2", "--fraction", "0.5", "--seed", "7",
            *("--secure-aggregation",) * secure, *extra]


def test_rank_0_receives_only_masked_uploads_whose_sum_is_the_quantized_sum(data_root, tmp_path, monkeypatch):
    """A real run in this process (rank 0 in this thread, the client host in another), instrumented: each client's
    quantized words before its masks, its float upload and coefficients, the words rank 0 folds, and its sums."""
    clients, received, sums, agreed = [], [], [], []
    mask, add_masks, add, dequantize = (secure_module.SecureRound.mask, secure_module.SecureRound._add_masks,
                                        folding_module.Folding.add, secure_module.SecureRound.sums)
    contribute = secure_module.SecureAggregation.setup_contribution

    def spy_mask(self, sampled, client, upload):
        floats = {r.upload: upload[r.upload].double().numpy().copy() for r in self.reductions.values()}
        clients.append({"round": self.round, "client": client, "secure": self, "upload": floats})
        return mask(self, sampled, client, upload)

    def spy_add_masks(self, words, sampled, client):
        clients[-1]["quantized"] = words.copy()
        add_masks(self, words, sampled, client)

    def spy_add(self, window):
        if any(c is None for c in self.coefficients.values()):
            received.extend({name: np.array(x) for name, x in upload.items()} for upload in window)
        add(self, window)

    def spy_sums(self, folded):
        out = dequantize(self, folded)
        sums.append(({n: np.array(s) for n, s in folded.items()}, out))
        return out

    def spy_contribute(self, client, data):
        agreed.append(threading.current_thread().name)
        return contribute(self, client, data)

    monkeypatch.setattr(secure_module.SecureRound, "mask", spy_mask)
    monkeypatch.setattr(secure_module.SecureRound, "_add_masks", spy_add_masks)
    monkeypatch.setattr(folding_module.Folding, "add", spy_add)
    monkeypatch.setattr(secure_module.SecureRound, "sums", spy_sums)
    monkeypatch.setattr(secure_module.SecureAggregation, "setup_contribution", spy_contribute)
    job = run_here(*_args(data_root, tmp_path / "run", "--rounds", "2"))
    assert job.returncode == 0, job.stderr
    assert len(agreed) == 10 and threading.main_thread().name not in agreed  # rank 0 (this thread) draws no secret
    assert len(clients) == len(received) == 10 and len(sums) == 2
    for r, (folded, dequantized) in enumerate(sums):
        round_clients, round_received = clients[5 * r:5 * r + 5], received[5 * r:5 * r + 5]
        secure = round_clients[0]["secure"]
        names = secure.layout.names
        quantized = np.stack([c["quantized"] for c in round_clients])
        sent = np.stack([np.concatenate([upload[n].reshape(-1) for n in names]) for upload in round_received])
        assert (sent == quantized).mean() < 1e-3  # no received buffer is its client's quantized upload
        assert np.abs(np.unpackbits(sent.view(np.uint8), axis=1).mean(axis=1) - 0.5).max() < 0.02
        total = np.concatenate([folded[n].reshape(-1) for n in names])
        assert np.array_equal(total, quantized.sum(axis=0, dtype=quantized.dtype))  # bitwise, modulo 2^32
        for name, reduction in secure.reductions.items():  # within the bound of the plain float64 fold
            plain = weighted_sum([c["upload"][reduction.upload] for c in round_clients], reduction.coefficients)
            assert np.abs(dequantized[name] - plain).max() <= secure.bound + 1e-15, name
