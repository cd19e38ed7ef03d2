"""A client rank reads only its own clients' domains and rows, normalized as --input-norm says."""

import dataclasses
import shutil

import numpy as np
import pytest
import torch

import mpifl.client.client_data as client_data
from mpifl.client.transforms import TrainTransforms
from mpifl.data import ensure_dataset
from mpifl.data.manifest import build_manifest
from mpifl.errors import MpiflError
from mpifl.plan.clients import make_clients
from mpifl.plan.normalize import check_input_norm, fixed


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


# ------------------------------------------------------------------ --input-norm


def _build(data_root, tmp_path, name: str, domains) -> tuple:
    """(root, manifest) of a copy of styledigits holding only ``domains``, its manifest pooled over them (as a
    converter writes it)."""
    ensure_dataset(data_root, "styledigits")
    root = tmp_path / name
    (root / "styledigits").mkdir(parents=True)
    for domain in domains:
        shutil.copy(data_root / "styledigits" / f"{domain}.h5", root / "styledigits" / f"{domain}.h5")
    return root, build_manifest(root, "styledigits", source="test", protocol={})


def _mono_inputs(root, manifest, mode: str) -> torch.Tensor:
    clients = [c for c in make_clients(manifest, 1, seed=0) if c.domain == "mono"]
    data = client_data.load_client_data(root, manifest, clients, torch.device("cpu"), input_norm=mode)
    return next(data[clients[0].id].eval_batches("train", 1000))[0]


@pytest.fixture(scope="module")
def builds(data_root, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("builds")
    return (_build(data_root, tmp_path, "two", ["mono", "street"]),
            _build(data_root, tmp_path, "three", ["mono", "paper", "texture"]))


def test_a_domains_inputs_do_not_depend_on_the_other_domains_under_domain_and_fixed(builds):
    two, three = builds
    assert not torch.allclose(_mono_inputs(*two, "pooled"), _mono_inputs(*three, "pooled"))  # today's rule
    for mode in ("domain", "fixed", "imagenet"):
        assert torch.equal(_mono_inputs(*two, mode), _mono_inputs(*three, mode)), mode
    x = _mono_inputs(*two, "domain").double()  # all 800 train images: the domain's own train statistics
    assert torch.allclose(x.mean(dim=(0, 2, 3)), torch.zeros(3, dtype=torch.float64), atol=1e-4)
    assert torch.allclose(x.std(dim=(0, 2, 3), unbiased=False), torch.ones(3, dtype=torch.float64), atol=1e-4)
    with client_data.open_shard(*two, "mono") as shard:
        pixels = torch.from_numpy(shard.load("train")[0].transpose(0, 3, 1, 2)).double()
    assert torch.allclose(_mono_inputs(*two, "fixed").double(), (pixels / 255 - 0.5) / 0.5, atol=1e-5)
    imagenet = (pixels / 255 - torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1).double()) \
        / torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1).double()
    assert torch.allclose(_mono_inputs(*two, "imagenet").double(), imagenet, atol=1e-5)


def test_a_held_out_domain_uses_its_own_train_statistics_under_domain(builds):
    root, manifest = builds[0]
    client = [c for c in make_clients(manifest, 1, seed=0, holdout="street") if c.domain == "street"]
    data = client_data.load_client_data(root, manifest, client, torch.device("cpu"), input_norm="domain")
    scale, shift = data[client[0].id].normalizer.eval()
    with client_data.open_shard(root, manifest, "street") as shard:
        mean, std = torch.from_numpy(shard.mean), torch.from_numpy(shard.std)
    assert torch.allclose(scale.flatten().double(), 1 / (255 * std), rtol=1e-6)
    assert torch.allclose(shift.flatten().double(), -mean / std, rtol=1e-6)


def test_input_norm_a_dataset_cannot_use_is_a_one_line_error(data_root):
    manifest = ensure_dataset(data_root, "styledigits")
    with pytest.raises(MpiflError, match="no fixed constants are known for dataset pacs"):
        check_input_norm("fixed", dataclasses.replace(manifest, name="pacs"))
    with pytest.raises(MpiflError, match="needs RGB images; styledigits has 1 channel"):
        check_input_norm("imagenet", dataclasses.replace(manifest, channels=1))
    one_channel = dataclasses.replace(manifest, name="prostate", channels=1)  # a build without its neighbours
    with pytest.raises(MpiflError, match="the constants of prostate are for 3 channels, this build of it has 1"):
        check_input_norm("fixed", one_channel)


# ------------------------------------------------------------------ --train-transforms on a segmentation task


def test_training_batches_move_each_mask_with_its_image():
    n, size = 40, 16
    masks = torch.zeros(n, size, size, dtype=torch.uint8)
    masks[:, 2:12, 1:4] = 1  # an L of two labels on the left: a flip or a turn moves it
    masks[:, 9:12, 4:8] = 2
    images = client_data.ResidentImages((masks * 100)[:, None].expand(n, 3, size, size).contiguous())
    data = client_data.ClientData({"train": images}, {"train": masks}, fixed([0.0] * 3, [1 / 255] * 3),
                                  TrainTransforms(("flip", "rotate", "crop")))  # scale 1, shift 0: x = pixels
    batches = list(data.train_batches(np.random.default_rng(3), 8))
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert y.dtype == torch.int64 and y.shape == (n, size, size) and set(y.unique().tolist()) <= {0, 1, 2}
    assert torch.equal(x, (y * 100)[:, None].expand(n, 3, size, size).float())  # every mask on its image
    left = (y == 1)[:, :, : size // 2].sum(dim=(1, 2)) > (y == 1)[:, :, size // 2:].sum(dim=(1, 2))
    assert 0 < left.sum() < n  # some flipped, some not
