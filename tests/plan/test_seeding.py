import numpy as np

from mpifl.plan.seeding import client_rng, client_torch_seed, sample_clients


def test_sampling_is_seeded_sorted_and_sized():
    a = sample_clients(seed=3, round_index=5, num_clients=20, fraction=0.3)
    assert np.array_equal(a, sample_clients(3, 5, 20, 0.3))
    assert len(a) == 6 and np.all(np.diff(a) > 0) and a.max() < 20
    assert not np.array_equal(a, sample_clients(3, 6, 20, 0.3))


def test_sampling_takes_at_least_one_and_all_at_fraction_one():
    assert len(sample_clients(0, 1, 10, 0.01)) == 1
    assert np.array_equal(sample_clients(0, 1, 4, 1.0), np.arange(4))


def test_sampling_varies_across_rounds_so_every_client_participates():
    seen = set()
    for r in range(1, 40):
        seen.update(sample_clients(0, r, 10, 0.2).tolist())
    assert seen == set(range(10))


def test_client_streams_depend_on_client_and_round_only():
    a = client_rng(1, 2, 3).permutation(100)
    assert np.array_equal(a, client_rng(1, 2, 3).permutation(100))
    assert not np.array_equal(a, client_rng(1, 3, 3).permutation(100))
    assert not np.array_equal(a, client_rng(1, 2, 4).permutation(100))
    assert client_torch_seed(1, 2, 3) == client_torch_seed(1, 2, 3) != client_torch_seed(1, 2, 4)
    assert 0 <= client_torch_seed(1, 2, 3) < 2**63
