"""A client rank reads only its own clients' domains and rows."""

import numpy as np
import torch

import mpifl.client.client_data as client_data
from mpifl.plan.clients import make_clients
from mpifl.data import ensure_dataset


def test_a_rank_opens_only_the_shards_of_the_domains_it_hosts(data_root, monkeypatch):
    manifest = ensure_dataset(data_root, "styledigits")
    opened = []
    real = client_data.open_shard

    def spy(root, man, domain):
        opened.append(domain)
        return real(root, man, domain)

    monkeypatch.setattr(client_data, "open_shard", spy)
    clients = make_clients(manifest, 2, seed=0)
    mine = [c for c in clients if c.domain in ("paper", "texture")]
    data = client_data.load_client_data(data_root, manifest, mine, torch.device("cpu"))
    assert opened == ["paper", "texture"]  # once each, in manifest order
    with real(data_root, manifest, "paper") as shard:
        images, labels = shard.load("train", indices=mine[0].rows["train"])
    assert torch.equal(data[mine[0].id].images["train"].pixels, torch.from_numpy(images.transpose(0, 3, 1, 2)))
    assert np.array_equal(data[mine[0].id].labels["train"].numpy(), labels)


def _both(data_root, holdout=None, block=300):
    manifest = ensure_dataset(data_root, "styledigits")
    clients = [c for c in make_clients(manifest, 1, seed=0, holdout=holdout) if c.domain == "street"]
    resident = client_data.load_client_data(data_root, manifest, clients, torch.device("cpu"))[clients[0].id]
    streamed = client_data.load_client_data(data_root, manifest, clients, torch.device("cpu"), stream_above_gib=0,
                                            block=block)[clients[0].id]
    assert isinstance(streamed.images["train"], client_data.StreamedImages)
    return resident, streamed


def test_streamed_epoch_visits_every_image_once_in_batches_of_the_right_size(data_root):
    resident, streamed = _both(data_root)
    batches = list(streamed.train_batches(np.random.default_rng(0), 32))
    assert all(len(y) == 32 for _, y in batches[:-1]) and len(batches) == 25  # 800 images, blocks of 300
    x = torch.cat([b[0] for b in batches])
    seen = torch.cat([b[1] for b in batches])
    assert len(x) == 800 and torch.equal(seen.sort().values, resident.labels["train"].sort().values)
    reference = {tuple(row.flatten()[:40].tolist()) for row, _ in zip(*next(resident.eval_batches("train", 800)))}
    assert {tuple(row.flatten()[:40].tolist()) for row in x} == reference  # the same images, reshuffled
    again = torch.cat([b[1] for b in streamed.train_batches(np.random.default_rng(0), 32)])
    assert torch.equal(seen, again)  # seeded


def test_streamed_evaluation_equals_resident_including_a_held_out_domain(data_root):
    resident, streamed = _both(data_root, holdout="street", block=256)
    assert streamed.size("test") == resident.size("test") == 1100 and streamed.size("train") == 0
    def whole(data):  # streamed batches end at block ends: compare the split, not batch by batch
        batches = list(data.eval_batches("test", 100))
        return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    (xr, yr), (xs, ys) = whole(resident), whole(streamed)
    assert torch.equal(xr, xs) and torch.equal(yr, ys)
    chunks = list(streamed.pixel_chunks("test"))
    assert sum(len(c) for c in chunks) == 1100


def test_pretrained_inputs_use_imagenet_mean_and_std_else_the_datasets(data_root):
    manifest = ensure_dataset(data_root, "styledigits")
    clients = [c for c in make_clients(manifest, 1, seed=0) if c.domain == "street"]
    for pretrained, mean, std in ((True, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
                                  (False, manifest.normalize["mean"], manifest.normalize["std"])):
        data = client_data.load_client_data(data_root, manifest, clients, torch.device("cpu"),
                                            pretrained=pretrained)[clients[0].id]
        x, _ = next(data.eval_batches("val", 4))
        pixels = data.images["val"].pixels[:4].double() / 255
        expected = (pixels - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
        assert torch.allclose(x.double(), expected, atol=1e-5)
