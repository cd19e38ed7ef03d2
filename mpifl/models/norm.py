"""Normalization- and conv-layer factories shared by every model.

``make_norm(kind, channels, dims)`` builds the layer that follows a conv
(``dims=2``, input N x C x H x W) or a linear layer (``dims=1``, input N x C).
The kinds are the normalizations the multi-domain FL papers compare:

``bn``
    BatchNorm1d/2d with torch's defaults (momentum 0.1, eps 1e-5): FedAvg,
    FedBN, SiloBN.
``gn``
    GroupNorm for FedWon's GN baseline (FedWon appendix A.2): 32 groups, or 8
    when the layer has fewer than 32 channels; when that target does not
    divide the channels, the largest divisor of the channel count not above
    the target (64 -> 32, 48 -> 24, 16 -> 8, 24 -> 8, 12 -> 6).
``ln``
    GroupNorm with one group, i.e. layer norm over (C, H, W) with a per-channel
    affine: the FedAvg+LN baseline.  On vectors it normalizes over C.
``in``
    InstanceNorm2d, affine, no running statistics.  Undefined on vectors, so
    ``dims=1`` raises; models that need a norm after a linear layer ask
    :func:`supports_vectors` first and use ``none`` there instead.
``none``
    ``nn.Identity``: FedWon and other normalization-free models.
``perxan``
    gPerXAN's XAN layer (:class:`~mpifl.models.perxan.PerXAN`): BN and IN
    outputs mixed by ``softmax([bn_score, in_score])``.  Conv layers only (its
    IN side is undefined on vectors, as ``in``).
``agn``
    FedNN's Adaptive Group Normalization
    (:class:`~mpifl.models.fednn.AdaptiveGroupNorm`): BN and 2-group GN
    statistics mixed by a Gumbel-softmax selection; 1 group when the channel
    count is odd.  Defined on vectors too (BN over the batch, GN over each
    half of the features).  FedNN's weight-normalized conv is the separate
    ``conv="wn"`` choice.
``jsbn``
    FedStein's JSNorm (:class:`~mpifl.models.jsbn.JSBatchNorm2d`): a
    BatchNorm (same state, classified ``bn``) that normalizes with
    James-Stein-shrunk batch statistics in training.
``ibn``
    IBN-Net's IBN-a layer (:class:`~mpifl.models.ibn.IBN`): IN (affine) on
    the first half of the channels, BN on the other half.  On vectors plain
    BatchNorm1d: IBN-a keeps BN wherever it puts no IN, and a feature vector
    has no spatial instance statistics.  Which norms stay IBN, and with which
    split (DenseNet: IN on the last 40 %), is the per-architecture rule of
    :func:`~mpifl.models.surgery.ibn_sites`.
``dson``
    DSON's optimized normalization (:class:`~mpifl.models.dson.DSON`): BN and
    IN statistics mixed by learned softmax weights, one affine; every entry
    domain-specific.  Conv layers only.

``perxan``, ``ibn`` and ``dson`` are the *composite* kinds
(:data:`COMPOSITE_KINDS`): their state has a BN side (``StateEntry.part``)
and they stand in the first stages of a model only when
:func:`~mpifl.models.surgery.place_composite_norms` says so.

The table :data:`_NORMS` maps kind -> builder; new kinds are new rows.

``make_conv(kind, in_channels, out_channels, kernel_size, stride, padding,
bias)`` builds a 2-D convolution of kind ``plain`` (``nn.Conv2d``), ``ws``
(FedWon's :class:`~mpifl.models.wsconv.WSConv2d`) or ``wn`` (FedNN's
:class:`~mpifl.models.fednn.WNConv2d`); :data:`_CONVS` is its table.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from torch import nn

from mpifl.errors import MpiflError
from mpifl.models.dson import DSON
from mpifl.models.fednn import AdaptiveGroupNorm, WNConv2d
from mpifl.models.ibn import IBN
from mpifl.models.jsbn import JSBatchNorm1d, JSBatchNorm2d
from mpifl.models.perxan import PerXAN
from mpifl.models.wsconv import WSConv2d


def gn_groups(channels: int) -> int:
    """Group count of the ``gn`` kind for a layer with ``channels`` channels."""
    target = 32 if channels >= 32 else 8
    return max(g for g in range(1, min(target, channels) + 1) if channels % g == 0)


def _batch_norm(channels: int, dims: int) -> nn.Module:
    return nn.BatchNorm2d(channels) if dims == 2 else nn.BatchNorm1d(channels)


def _group_norm(channels: int, dims: int) -> nn.Module:
    return nn.GroupNorm(gn_groups(channels), channels)


def _layer_norm(channels: int, dims: int) -> nn.Module:
    return nn.GroupNorm(1, channels)


def _instance_norm(channels: int, dims: int) -> nn.Module:
    return nn.InstanceNorm2d(channels, affine=True, track_running_stats=False)


def _identity(channels: int, dims: int) -> nn.Module:
    return nn.Identity()


def _jsbn(channels: int, dims: int) -> nn.Module:
    return JSBatchNorm2d(channels) if dims == 2 else JSBatchNorm1d(channels)


def _perxan(channels: int, dims: int) -> nn.Module:
    return PerXAN(channels)


def _ibn(channels: int, dims: int) -> nn.Module:
    return IBN(channels) if dims == 2 else nn.BatchNorm1d(channels)


def _dson(channels: int, dims: int) -> nn.Module:
    return DSON(channels)


def _agn(channels: int, dims: int) -> nn.Module:
    return AdaptiveGroupNorm(channels, num_groups=2 if channels % 2 == 0 else 1)


class _NormSpec(NamedTuple):
    build: Callable[[int, int], nn.Module]
    on_vectors: bool  # defined after a linear layer (dims=1)


_NORMS: dict[str, _NormSpec] = {
    "bn": _NormSpec(_batch_norm, True),
    "gn": _NormSpec(_group_norm, True),
    "ln": _NormSpec(_layer_norm, True),
    "in": _NormSpec(_instance_norm, False),
    "none": _NormSpec(_identity, True),
    "perxan": _NormSpec(_perxan, False),
    "agn": _NormSpec(_agn, True),
    "jsbn": _NormSpec(_jsbn, True),
    "ibn": _NormSpec(_ibn, True),
    "dson": _NormSpec(_dson, False),
}

NORM_KINDS: tuple[str, ...] = tuple(_NORMS)
#: kinds whose layers have a BN side and go in a model's first stages (``--norm-blocks``)
COMPOSITE_KINDS: tuple[str, ...] = ("perxan", "ibn", "dson")


def _spec(kind: str) -> _NormSpec:
    if kind not in _NORMS:
        raise MpiflError(
            f"unknown norm {kind!r}; choose one of: {', '.join(NORM_KINDS)}"
        )
    return _NORMS[kind]


def supports_vectors(kind: str) -> bool:
    """Whether ``kind`` is defined on feature vectors (after a linear layer)."""
    return _spec(kind).on_vectors


def make_norm(kind: str, channels: int, dims: int = 2) -> nn.Module:
    """Build the ``kind`` normalization for ``channels`` channels.

    ``dims`` is 2 after a conv (N x C x H x W) and 1 after a linear layer
    (N x C).  Unknown kinds, and kinds undefined on vectors with ``dims=1``,
    raise :class:`MpiflError`.
    """
    if dims not in (1, 2):
        raise ValueError(f"dims must be 1 or 2, got {dims}")
    spec = _spec(kind)
    if dims == 1 and not spec.on_vectors:
        raise MpiflError(
            f"norm {kind!r} is undefined on feature vectors (after a linear "
            f"layer); use it on conv layers only, or pick one of: "
            f"{', '.join(k for k in NORM_KINDS if _NORMS[k].on_vectors)}"
        )
    return spec.build(channels, dims)


_CONVS: dict[str, Callable[..., nn.Conv2d]] = {
    "plain": nn.Conv2d,
    "ws": WSConv2d,
    "wn": WNConv2d,
}

CONV_KINDS: tuple[str, ...] = tuple(_CONVS)


def make_conv(
    kind: str,
    in_channels: int,
    out_channels: int,
    kernel_size: int,
    stride: int = 1,
    padding: int = 0,
    bias: bool = True,
) -> nn.Conv2d:
    """Build a 2-D convolution of ``kind`` (``plain``, ``ws`` or ``wn``).

    Unknown kinds raise :class:`MpiflError`.
    """
    if kind not in _CONVS:
        raise MpiflError(
            f"unknown conv {kind!r}; choose one of: {', '.join(CONV_KINDS)}"
        )
    return _CONVS[kind](in_channels, out_channels, kernel_size, stride, padding, bias=bias)
