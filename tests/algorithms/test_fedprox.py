"""FedProx: its option mu is a weight, refused below 0 (a negative proximal term pushes clients apart)."""

import pytest

from mpifl.errors import MpiflError

from .helpers import gradients_after_shift, make_algo


@pytest.mark.parametrize("mu", [-1.0, -1e-9])
def test_a_negative_mu_is_refused_in_one_line(mu):
    with pytest.raises(MpiflError, match=rf"^--mu must be >= 0, got {mu}$"):
        make_algo("fedprox", mu=mu)


def test_mu_zero_adds_no_gradient():
    algo, model = make_algo("fedprox", mu=0.0)
    assert all(float(g.abs().max()) == 0.0 for g in gradients_after_shift(algo, model))
