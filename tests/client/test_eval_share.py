"""A rank's share of the global model's evaluation: the host scores its batches from its own images, another rank
from the rows it reads, resident or streamed; added up in batch order they are one pass over the split, bit for
bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import mpifl.client.eval_share as eval_share
from mpifl.client.client_data import load_client_data
from mpifl.client.eval_share import EvalShare
from mpifl.client.training import batch_scores, evaluate
from mpifl.data import ensure_dataset, open_shard
from mpifl.models import build_model
from mpifl.plan.batches import eval_bounds, split_segments, streams
from mpifl.plan.clients import make_clients
from mpifl.session.evaluation import EvalBatch, EvalPlan

CPU = torch.device("cpu")


@pytest.mark.parametrize("stream_above", [math.inf, 0.0])
def test_two_ranks_shares_of_a_held_out_domain_add_up_to_one_pass_over_it(data_root, stream_above, monkeypatch):
    manifest = ensure_dataset(data_root, "styledigits")
    clients = make_clients(manifest, 1, seed=0, holdout="street")
    spec = next(c for c in clients if not c.trains)
    image_bytes = int(np.prod(manifest.image_size)) * manifest.channels
    bounds = eval_bounds(split_segments(spec)["test"], 64, streams(spec, image_bytes, stream_above))
    batches = [EvalBatch(spec.id, 1, start, stop) for start, stop in bounds]
    assert len(batches) == (19 if stream_above == 0 else 18)  # 800 + 100 + 200 rows: streamed, a batch ends with each
    hosted = load_client_data(data_root, manifest, [spec], CPU, stream_above_gib=stream_above)
    torch.manual_seed(0)
    model = build_model("smallcnn", num_classes=10, image_size=tuple(manifest.image_size))
    whole = evaluate(model, hosted[spec.id], "test", 64)
    opened = []

    def spy(root, man, domain):
        opened.append(domain)
        return open_shard(root, man, domain)

    monkeypatch.setattr(eval_share, "open_shard", spy)
    shares = [EvalShare(data_root, manifest, clients, tuple(batches[0::2]), hosted, CPU, "pooled", stream_above),
              EvalShare(data_root, manifest, clients, tuple(batches[1::2]), {}, CPU, "pooled", stream_above)]
    # the first is the host's: resident, it reads nothing; the other rank reads its rows once
    assert opened == ["street"] * (1 + (stream_above == 0))
    scores = [torch.stack([torch.stack(batch_scores(model, x, y)) for _, x, y in share]).numpy() for share in shares]
    plan = EvalPlan(kinds=("global",), num_clients=len(clients), batches=tuple(batches),
                    rank_of=tuple(1 + i % 2 for i in range(len(batches))), personal=((), ()), images=(0, 0))
    assert plan.add_up(scores, {})[spec.id][0, 1].tolist() == list(whole)
