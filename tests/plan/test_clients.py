import numpy as np
import pytest

from mpifl.plan.clients import SPLITS, make_clients
from mpifl.data import DatasetManifest
from mpifl.errors import MpiflError


def _manifest():
    sizes = {"a": {"train": 101, "val": 10, "test": 20}, "b": {"train": 50, "val": 7, "test": 9}}
    return DatasetManifest(name="toy", domains=["a", "b"], classes=["x", "y"], image_size=(8, 8), channels=3,
                           splits=sizes, normalize={"mean": [0.5] * 3, "std": [0.5] * 3}, shards={}, source="",
                           protocol={}, format_version=1)


def test_cross_silo_one_client_per_domain_with_every_row():
    clients = make_clients(_manifest(), 1, seed=0)
    assert [(c.id, c.domain) for c in clients] == [(0, "a"), (1, "b")]
    assert all(np.array_equal(c.rows["train"], np.arange(c.num_train)) for c in clients)


def test_cross_device_parts_are_seeded_disjoint_covering_and_balanced():
    manifest = _manifest()
    clients = make_clients(manifest, 4, seed=3)
    assert [c.id for c in clients] == list(range(8))
    for domain in manifest.domains:
        mine = [c for c in clients if c.domain == domain]
        for split in SPLITS:
            parts = [c.rows[split] for c in mine]
            joined = np.concatenate(parts)
            assert sorted(joined.tolist()) == list(range(manifest.splits[domain][split]))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    again = make_clients(manifest, 4, seed=3)
    other = make_clients(manifest, 4, seed=4)
    assert all(np.array_equal(x.rows["train"], y.rows["train"]) for x, y in zip(clients, again))
    assert any(not np.array_equal(x.rows["train"], y.rows["train"]) for x, y in zip(clients, other))


def test_holdout_domain_is_one_evaluation_only_client():
    clients = make_clients(_manifest(), 3, seed=0, holdout="a")
    held = [c for c in clients if c.domain == "a"]
    assert len(held) == 1 and not held[0].trains and held[0].num_train == 0
    assert [len(held[0].rows[s]) for s in SPLITS] == [101, 10, 20]
    assert sum(c.trains for c in clients) == 3


def test_unknown_holdout_domain():
    with pytest.raises(MpiflError, match="--holdout c is not a domain of toy; choose one of: a, b"):
        make_clients(_manifest(), 1, seed=0, holdout="c")


def test_num_clients_are_dealt_over_the_domains_in_turn():
    clients = make_clients(_manifest(), 1, seed=0, num_clients=5)
    assert [c.domain for c in clients] == ["a", "a", "a", "b", "b"]
    with pytest.raises(MpiflError, match="--num-clients 1 is fewer than the 2 training domains"):
        make_clients(_manifest(), 1, seed=0, num_clients=1)


def _labels(manifest, seed=0):
    rng = np.random.default_rng(seed)
    return {d: {s: rng.integers(0, 2, size=n) for s, n in manifest.splits[d].items()} for d in manifest.domains}


def test_dirichlet_parts_are_disjoint_covering_seeded_and_label_skewed():
    manifest = _manifest()
    labels = _labels(manifest)
    clients = make_clients(manifest, 3, seed=1, dirichlet=0.1, labels=labels)
    for domain in manifest.domains:
        mine = [c for c in clients if c.domain == domain]
        for split in SPLITS:
            joined = np.concatenate([c.rows[split] for c in mine])
            assert sorted(joined.tolist()) == list(range(manifest.splits[domain][split]))
    mixes = [np.bincount(labels["a"]["train"][c.rows["train"]], minlength=2) / max(c.num_train, 1)
             for c in clients if c.domain == "a"]
    assert max(abs(m[0] - mixes[0][0]) for m in mixes) > 0.2  # alpha 0.1: clients see different label mixes
    again = make_clients(manifest, 3, seed=1, dirichlet=0.1, labels=labels)
    assert all(np.array_equal(x.rows["val"], y.rows["val"]) for x, y in zip(clients, again))


def test_samples_per_client_gives_equal_seeded_training_subsets():
    clients = make_clients(_manifest(), 2, seed=0, samples_per_client=20)
    assert all(c.num_train == 20 for c in clients)
    assert all(len(np.unique(c.rows["train"])) == 20 for c in clients)
    assert len(clients[0].rows["test"]) == 10  # evaluation rows are not cut
    with pytest.raises(MpiflError, match="fewer than --samples-per-client 30"):
        make_clients(_manifest(), 2, seed=0, samples_per_client=30)


def test_percent_keeps_a_seeded_fraction_of_each_clients_training_rows():
    full = make_clients(_manifest(), 2, seed=0)
    tenth = make_clients(_manifest(), 2, seed=0, percent=0.1)
    for whole, part in zip(full, tenth):
        assert part.num_train == round(0.1 * whole.num_train)
        assert set(part.rows["train"]) < set(whole.rows["train"])
        assert np.array_equal(part.rows["test"], whole.rows["test"])
    again = make_clients(_manifest(), 2, seed=0, percent=0.1)
    assert all(np.array_equal(a.rows["train"], b.rows["train"]) for a, b in zip(tenth, again))
