"""Models, normalization and conv layers, and state-dict entry classification.

``build_model`` builds a registered model (``MODEL_NAMES``) with a chosen
normalization (``NORM_KINDS``) and convolution (``CONV_KINDS``);
``state_entries`` classifies its state-dict entries for share policies
(docs/methods.md, "What a method reads").  The papers' layers and functions:

* FedWon: :class:`WSConv2d` (``conv="ws"``), :func:`adaptive_clip_` (AGC);
* FedNN: :class:`WNConv2d` (``conv="wn"``), :class:`AdaptiveGroupNorm`
  (``norm="agn"``), :func:`set_agn_tau`;
* gPerXAN: :class:`PerXAN` (``norm="perxan"``), :func:`load_bn_state`;
* FedStein: :func:`james_stein`;
* IBN-Net: :class:`IBN` (``norm="ibn"``); DSON: :class:`DSON` (``norm="dson"``);
  :func:`place_composite_norms` puts PerXAN, IBN and DSON in a model's first stages;
* CCST: the AdaIN style network (:mod:`mpifl.models.adain`), loaded from local weights.

The papers' backbones are registry entries (``alexnet``, ``alexnet-dropout``,
``lenet``, ``resnet20``, ``resnet18``, ``resnet50``, ``mobilenetv2``,
``densenet121``; the segmentation ``unet``); :func:`replace_norms` / :func:`replace_convs` swap layer
kinds in any model, and :func:`load_pretrained` loads a local
torchvision-format checkpoint (``--pretrained PATH``).
"""

from mpifl.models.agc import adaptive_clip_, unitwise_norm
from mpifl.models.entries import StateEntry, state_entries
from mpifl.models.fednn import AdaptiveGroupNorm, WNConv2d, set_agn_tau
from mpifl.models.jsbn import james_stein, james_stein_factor
from mpifl.models.dson import DSON
from mpifl.models.ibn import IBN
from mpifl.models.norm import COMPOSITE_KINDS, CONV_KINDS, NORM_KINDS, make_conv, make_norm
from mpifl.models.perxan import PerXAN, load_bn_state, perxan_state_from_bn
from mpifl.models.pretrained import PretrainedLoad, load_pretrained
from mpifl.models.registry import MODEL_DESCRIPTIONS, MODEL_NAMES, build_model
from mpifl.models.surgery import place_composite_norms, replace_convs, replace_norms, set_input_channels
from mpifl.models.wsconv import WSConv2d

__all__ = [
    "COMPOSITE_KINDS",
    "CONV_KINDS",
    "MODEL_DESCRIPTIONS",
    "MODEL_NAMES",
    "NORM_KINDS",
    "AdaptiveGroupNorm",
    "DSON",
    "IBN",
    "PerXAN",
    "PretrainedLoad",
    "StateEntry",
    "WNConv2d",
    "WSConv2d",
    "adaptive_clip_",
    "build_model",
    "james_stein",
    "james_stein_factor",
    "load_bn_state",
    "load_pretrained",
    "make_conv",
    "make_norm",
    "perxan_state_from_bn",
    "place_composite_norms",
    "replace_convs",
    "replace_norms",
    "set_agn_tau",
    "set_input_channels",
    "state_entries",
    "unitwise_norm",
]
