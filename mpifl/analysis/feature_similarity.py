"""Cosine similarity of last-conv feature maps between client models and with the server model.

FedWon (Zhuang & Lyu, ICLR 2024) Fig. 5 compares the feature maps of the last convolution
layer of two client local models and the server's global model on
Office-Caltech-10, and tabulates "the average cosine similarity of all
feature maps" between client models (C<->C) and between the server model and
a client model (S<->C) (FedAvg w/o BN 0.811 / 0.873, FedAvg 0.865 / 0.869,
FedBN 0.901 / 0.929, FedWon 0.993 / 0.997).  The paper does not define the
average further; here, for models a and b and a batch of N test images of
one client (its first ``--images`` test images, normalized as the run
normalizes that client's inputs, models in eval mode):

* the output F of the last ``Conv2d`` in module order (before its norm and
  activation), N x C x H x W;
* ``cos_maps``: the cosine similarity of each feature map (one channel of one
  image, H x W values) of a with the same map of b, averaged over the maps
  whose norm is non-zero in both models;
* ``cos_images``: the cosine of each image's whole feature tensor, averaged
  over images.

Every analysed client's image batch is passed through every model (each
analysed client's, see ``--models`` in :mod:`mpifl.analysis.checkpoints`,
and the server's); C<->C averages the client pairs, S<->C the client-server
pairs, over all image batches.  With ``--models checkpoint`` and a method
without private layers (FedAvg, FedWon ...), every client model is the
global model and every similarity is 1: FedWon's client models are local
models after local training, which ``--models local`` (default) rebuilds.

Outputs: ``feature-similarity.csv`` (one row per image batch and model pair)
and ``feature-similarity.png`` (the model x model matrix of ``cos_maps``
averaged over image batches, with the C<->C and S<->C means in the title).
"""

from __future__ import annotations

import csv
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import nn
from torch.nn.modules.conv import _ConvNd

from mpifl.analysis.checkpoints import Checkpointed, client_states, describe
from mpifl.errors import MpiflError

EPS = 1e-12


def last_conv(model: nn.Module) -> str:
    """Name of the last convolution module in registration order."""
    names = [name for name, module in model.named_modules() if isinstance(module, _ConvNd)]
    if not names:
        raise MpiflError("the model has no convolution layer: no feature maps to compare")
    return names[-1]


@torch.no_grad()
def feature_maps(model: nn.Module, layer: str, images: torch.Tensor) -> torch.Tensor:
    """The output of module ``layer`` for ``images`` (model in eval mode)."""
    captured = []
    handle = dict(model.named_modules())[layer].register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    try:
        model.eval()
        model(images)
    finally:
        handle.remove()
    return captured[0].double()


def cosine(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(mean cosine over feature maps with non-zero norm in both, mean cosine over images)."""
    maps_a, maps_b = a.flatten(2), b.flatten(2)  # N x C x HW
    dot = (maps_a * maps_b).sum(-1)
    norms = maps_a.norm(dim=-1) * maps_b.norm(dim=-1)
    valid = norms > EPS
    per_map = float((dot[valid] / norms[valid]).mean()) if valid.any() else float("nan")
    flat_a, flat_b = a.flatten(1), b.flatten(1)
    per_image = torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=1, eps=EPS)
    return per_map, float(per_image.mean())


@dataclass
class FeatureSimilarity:
    layer: str
    models: list[str]
    rows: list[dict]
    note: str
    caption: str = ""

    def matrix(self, measure: str = "cos_maps") -> np.ndarray:
        index = {m: i for i, m in enumerate(self.models)}
        out = np.eye(len(self.models))
        for a, b in itertools.combinations(self.models, 2):
            values = [r[measure] for r in self.rows if {r["a"], r["b"]} == {a, b}]
            out[index[a], index[b]] = out[index[b], index[a]] = np.mean(values) if values else np.nan
        return out

    def summary(self, measure: str = "cos_maps") -> dict[str, float]:
        return {kind: float(np.mean([r[measure] for r in self.rows if r["kind"] == kind] or [np.nan]))
                for kind in ("C<->C", "S<->C")}


def compute(ckpt: Checkpointed, clients: list[int], models: str = "local", images: int = 64) -> FeatureSimilarity:
    if images < 1:
        raise MpiflError("--images must be >= 1")
    states = {f"client {c} ({ckpt.domain(c)})": s for c, s in client_states(ckpt, clients, models).items()}
    states["server"] = ckpt.server_state()
    built = {name: ckpt.build(state) for name, state in states.items()}
    layer = last_conv(next(iter(built.values())))
    names = list(built)
    pairs = [(a, b, "C<->C") for a, b in itertools.combinations(names[:-1], 2)]
    pairs += [(a, "server", "S<->C") for a in names[:-1]]
    rows = []
    for cid in clients:
        batch = next(ckpt.client_data(cid).eval_batches("test", images), None)
        if batch is None:
            raise MpiflError(f"client {cid} ({ckpt.domain(cid)}) has no test images")
        x = batch[0].to(ckpt.device)
        features = {name: feature_maps(model, layer, x) for name, model in built.items()}
        for a, b, kind in pairs:
            per_map, per_image = cosine(features[a], features[b])
            rows.append({"images_of": f"client {cid} ({ckpt.domain(cid)})", "images": len(x), "kind": kind,
                         "a": a, "b": b, "cos_maps": per_map, "cos_images": per_image})
    note, caption = describe(ckpt, models)
    return FeatureSimilarity(layer=layer, models=names, rows=rows, note=note, caption=caption)


def write(result: FeatureSimilarity, out: Path, title: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    table = out / "feature-similarity.csv"
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["images_of", "images", "kind", "a", "b", "cos_maps", "cos_images"])
        writer.writeheader()
        writer.writerows(result.rows)
    matrix = result.matrix()
    summary = result.summary()
    size = 1.2 + 0.9 * len(result.models)
    fig = Figure(figsize=(size + 2.5, size), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(matrix, vmin=min(0.0, float(np.nanmin(matrix))), vmax=1.0, cmap="viridis")
    ax.set_xticks(range(len(result.models)), result.models, rotation=45, ha="right", fontsize="small")
    ax.set_yticks(range(len(result.models)), result.models, fontsize="small")
    for i, j in itertools.product(range(len(result.models)), repeat=2):
        ax.text(j, i, f"{matrix[i, j]:.3f}", ha="center", va="center", fontsize="small",
                color="white" if matrix[i, j] < 0.6 else "black")
    fig.colorbar(image, ax=ax, label="mean cosine similarity of feature maps")
    ax.set_title(f"{title}: cosine similarity of last-conv feature maps ({result.layer})\n"
                 f"C<->C {summary['C<->C']:.3f}, S<->C {summary['S<->C']:.3f}\n{result.caption}", fontsize="small")
    path = out / "feature-similarity.png"
    fig.savefig(path)
    return [table, path]
