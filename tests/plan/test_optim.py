"""The local optimizer of every method: learning-rate schedules, sgd/adam, the gradient clip, kept state."""

import math

import numpy as np
import pytest
import torch

from mpifl.errors import MpiflError
from mpifl.plan.clients import ClientSpec
from mpifl.plan.config import RunConfig, check
from mpifl.plan.optim import build_optimizer, round_lr

from ..algorithms.helpers import local_round, make_algo


def _lrs(indices, **kw):
    cfg = RunConfig(lr=0.1, **kw)
    return [round_lr(cfg, r) for r in indices]


def test_exp_and_step_schedules_start_at_lr_in_round_one():
    assert _lrs([1, 2, 11]) == [0.1, 0.1, 0.1]
    assert _lrs([1, 2, 11], lr_schedule="exp", lr_gamma=0.998) == pytest.approx([0.1, 0.0998, 0.1 * 0.998 ** 10])
    assert _lrs([1, 3, 4, 6, 7], lr_schedule="step", lr_gamma=0.5, lr_step=3) == pytest.approx(
        [0.1, 0.1, 0.05, 0.05, 0.025])


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_cosine_steps_before_each_round_down_to_lr_min_in_round_r_and_stays():
    """gPerXAN's code: CosineAnnealingLR(T_max=R) stepped before each round's training."""
    assert _lrs([1, 2, 4, 6], lr_schedule="cosine", rounds=4) == pytest.approx(
        [0.1 * (1 + math.cos(math.pi / 4)) / 2, 0.05, 0.0, 0.0], abs=1e-12)
    assert _lrs([2], lr_schedule="cosine", rounds=4, lr_min=0.01) == pytest.approx([0.055])
    # R is the stored horizon, not --rounds: a run resumed with more rounds keeps its schedule
    assert _lrs([2], lr_schedule="cosine", rounds=8, schedule_rounds=4) == pytest.approx([0.05])
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=5)
    torch_lrs = []
    for _ in range(5):
        scheduler.step()
        torch_lrs.append(optimizer.param_groups[0]["lr"])
    assert _lrs(range(1, 6), lr_schedule="cosine", rounds=5) == pytest.approx(torch_lrs, abs=1e-12)


def test_the_round_lr_is_the_methods_optimizer_lr_and_scaffolds_eta():
    algo, model = make_algo("scaffold", {"lr": 0.1, "rounds": 5, "lr_schedule": "exp", "lr_gamma": 0.5})
    algo.enter_round(3)
    assert algo.lr == pytest.approx(0.025)
    optimizer = algo.make_optimizer(model, algo.lr)
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


def _one_step(optimizer_name, **kw):
    p = torch.nn.Parameter(torch.tensor([1.0]))
    cfg = RunConfig(optimizer=optimizer_name, weight_decay=0.1, **kw)
    optimizer = build_optimizer([p], cfg, 0.001)
    p.grad = torch.tensor([2.0])
    optimizer.step()
    return float(p.detach())


def test_sgd_and_adam_steps():
    # g = 2 + 0.1 * 1 = 2.1 (L2 weight decay); SGD moves lr g, Adam's first step lr g / |g| = lr
    assert _one_step("sgd") == pytest.approx(1 - 0.001 * 2.1)
    assert _one_step("adam") == pytest.approx(1 - 0.001, abs=1e-7)


@pytest.mark.parametrize("kw,message", [
    ({"optimizer": "adam", "momentum": 0.9}, "--momentum applies to --optimizer sgd only"),
    ({"keep_optimizer": True}, "--keep-optimizer keeps SGD momentum buffers and --momentum is 0"),
    ({"optimizer": "rmsprop"}, "--optimizer must be one of sgd, adam"),
    ({"lr_schedule": "linear"}, "--lr-schedule must be one of none, cosine, step, exp"),
    ({"lr_min": 0.5}, r"--lr-min must be in \[0, --lr\]"),
    ({"lr_step": 0}, "--lr-step must be >= 1"),
    ({"max_grad_norm": -1.0}, "--max-grad-norm must be >= 0"),
])
def test_bad_optimizer_options_are_one_line_errors(kw, message):
    with pytest.raises(MpiflError, match=message):
        check(RunConfig(**kw))
    check(RunConfig(optimizer="adam", keep_optimizer=True))


def _client(algo, model):
    return algo.init_client(ClientSpec(id=0, domain="d", rows={"train": np.arange(4)}), model.state_dict())


def _ones_loss(model):
    return sum(p.sum() for p in model.parameters())  # gradient 1 on every element


def test_kept_sgd_momentum_carries_into_the_clients_next_round():
    """lr 0.1, momentum 0.5, gradient 1: round 1's step moves 0.1 (buffer 1); round 2's moves 0.15 (buffer
    0.5 * 1 + 1) when the buffer is kept, 0.1 again when the optimizer is fresh."""
    for keep, second in ((True, 0.15), (False, 0.1)):
        algo, model = make_algo("fedavg", {"lr": 0.1, "momentum": 0.5, "keep_optimizer": keep})
        client = _client(algo, model)
        download = {k: v.detach().clone() for k, v in model.state_dict().items()}
        key = "fc.weight" if "fc.weight" in download else next(n for n, _ in model.named_parameters())
        moves = []
        for _ in range(2):
            up = local_round(algo, model, client, download, 1, loss_fn=_ones_loss)
            moves.append(float((download[key] - torch.from_numpy(up[key])).mean()))
        assert moves == pytest.approx([0.1, second])
        kept = sorted(k for k in client.private if k.startswith("optimizer/"))
        assert kept == (sorted(f"optimizer/{n}/momentum_buffer" for n, _ in model.named_parameters()) if keep else [])
        if keep:
            assert torch.equal(client.private[f"optimizer/{key}/momentum_buffer"],
                               torch.full_like(download[key], 1.5))


def test_kept_adam_moments_and_step_count():
    algo, model = make_algo("fedavg", {"lr": 0.001, "optimizer": "adam", "keep_optimizer": True})
    client = _client(algo, model)
    download = {k: v.detach().clone() for k, v in model.state_dict().items()}
    name = next(n for n, _ in model.named_parameters())
    for _ in range(2):
        local_round(algo, model, client, download, 1, loss_fn=_ones_loss)
    assert float(client.private[f"optimizer/{name}/step"]) == 2.0  # 1 after each round if fresh
    exp_avg = client.private[f"optimizer/{name}/exp_avg"]
    torch.testing.assert_close(exp_avg, torch.full_like(exp_avg, 1 - 0.9 ** 2))


def test_the_gradient_clip_follows_the_methods_corrections():
    """Gradient 1 + the method's correction 3 = 4 on every one of N elements: norm 4 sqrt(N); clipped to 2,
    each element's step (lr 1) is 2 / sqrt(N).  Clipping before the correction would step 3 + 2 / sqrt(N)."""
    algo, model = make_algo("fedavg", {"lr": 1.0, "max_grad_norm": 2.0})

    def correct(client, model):
        for p in model.parameters():
            p.grad.add_(3.0)

    algo.after_backward = correct
    n = sum(p.numel() for p in model.parameters())
    download = {k: v.detach().clone() for k, v in model.state_dict().items()}
    up = local_round(algo, model, _client(algo, model), download, 1, loss_fn=_ones_loss)
    name = next(n for n, _ in model.named_parameters())
    step = download[name] - torch.from_numpy(up[name])
    torch.testing.assert_close(step, torch.full_like(step, 2.0 / math.sqrt(n)), rtol=1e-5, atol=1e-7)
