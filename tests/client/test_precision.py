"""--precision and --channels-last: autocast forward, fp32 weights, true gradients for the methods' hooks."""

import pytest
import torch
import torch.nn.functional as F

from mpifl.models import build_model
from mpifl.client.precision import Precision


def _grads(precision: Precision):
    torch.manual_seed(0)
    model = build_model("smallcnn", num_classes=10, norm="bn", conv="plain")
    if precision.channels_last:
        model.to(memory_format=torch.channels_last)
    x, y = torch.randn(8, 3, 16, 16), torch.arange(8) % 10
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with precision.autocast():
        loss = F.cross_entropy(model(precision.inputs(x)), y)
    precision.backward(loss, optimizer)
    return loss, [p.grad.clone() for p in model.parameters()], model


@pytest.mark.parametrize("name,tol", [("bf16", 0.2), ("fp16", 0.03)])  # relative error of the whole gradient
def test_mixed_precision_gradients_are_fp32_true_gradients(name, tol):
    _, reference, _ = _grads(Precision("fp32", torch.device("cpu")))
    loss, grads, model = _grads(Precision(name, torch.device("cpu")))
    assert loss.dtype == torch.float32  # cross-entropy runs in fp32 under autocast
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(g.dtype == torch.float32 for g in grads)
    g, r = torch.cat([g.flatten() for g in grads]), torch.cat([r.flatten() for r in reference])
    assert torch.linalg.norm(g - r) <= tol * torch.linalg.norm(r)  # unscaled: not 2**16 times fp32's


def test_bf16_autocast_really_computes_in_bf16():
    precision = Precision("bf16", torch.device("cpu"))
    with precision.autocast():
        out = torch.nn.functional.linear(torch.randn(4, 8), torch.randn(3, 8))
    assert out.dtype == torch.bfloat16


def test_channels_last_gives_the_same_gradients():
    _, reference, _ = _grads(Precision("fp32", torch.device("cpu")))
    _, grads, model = _grads(Precision("fp32", torch.device("cpu"), channels_last=True))
    conv = next(p for p in model.parameters() if p.dim() == 4)
    assert conv.is_contiguous(memory_format=torch.channels_last)
    assert all(torch.allclose(g, r, atol=1e-5) for g, r in zip(grads, reference))


def test_compile_option_compiles_the_feature_extractor_of_every_client_rank(monkeypatch):
    """The wiring only: a real torch.compile costs ~20 s of this machine's CPU per rank."""
    import mpifl.client.host as host_module
    from mpifl.plan.config import RunConfig

    compiled = []
    monkeypatch.setattr(host_module.torch, "compile", lambda fn: compiled.append(fn) or fn)
    monkeypatch.setattr(host_module, "load_client_data", lambda *a, **k: {})

    class Session:
        cfg = RunConfig(compile=True)
        placement = [[]]
        clients = []
        manifest = None
        initial = {}
        algo = None

        def build_model(self):
            return build_model("smallcnn", num_classes=10, norm="bn", conv="plain")

    class Comm:
        rank = 1

        def cuda_aware(self):
            return None

    host = host_module.ClientHost(Session(), Comm(), torch.device("cpu"), run_dir=None)
    assert compiled and compiled[0].__name__ == "encode" and host.model.encode is compiled[0]
