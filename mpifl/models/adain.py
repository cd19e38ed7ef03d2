"""The AdaIN style-transfer network (Huang & Belongie, "Arbitrary Style Transfer in Real-time with Adaptive
Instance Normalization", ICCV 2017), as CCST (:mod:`mpifl.algorithms.ccst`) uses it.

* **Encoder**: VGG-19 up to relu4_1, preceded by the 1 x 1 convolution (3 -> 3) of the "normalised" VGG
  that takes [0, 1] RGB input; every 3 x 3 convolution is reflection-padded, max pools are 2 x 2 with
  ``ceil_mode``.  Output: 512 channels at 1/8 of the input size (rounded up).
* **Decoder**: the encoder mirrored, nearest-neighbour 2x upsampling in place of the pools, no ReLU after
  its last convolution.  Output: 3 channels at 8 times the feature size.
* **AdaIN** of content features f_c with style statistics (mu_s, sigma_s), per channel::

      AdaIN(f_c) = sigma_s (f_c - mu(f_c)) / sigma(f_c) + mu_s

  mu, sigma over the spatial positions of each image, sigma^2 the unbiased variance + 1e-5, as the
  AdaIN code computes a content image's statistics.

Weights are never downloaded: :func:`load_style_model` reads ``vgg_normalised.pth`` and ``decoder.pth``, the
two files the AdaIN code and CCST's README distribute (``torch.save`` of an ``nn.Sequential``'s state, keys
"<layer index>.weight"/".bias"), from a local folder.  Both networks here are ``nn.Sequential`` with the same
layer indices, so those files load as they are; the VGG file's layers past relu4_1 are not used.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import MpiflError

EPS = 1e-5  # added to every variance, as the AdaIN and CCST code do
FEATURES = 512  # relu4_1's channels: the length of a style's mean and of its std
ENCODER_FILE, DECODER_FILE = "vgg_normalised.pth", "decoder.pth"

# widths of the 3 x 3 convolutions, "M" a 2 x 2 max pool: VGG-19 up to relu4_1
_ENCODER = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512)
# widths of the decoder's 3 x 3 convolutions from 512 channels, "U" a 2x upsampling
_DECODER = (256, "U", 256, 256, 256, 128, "U", 128, 64, "U", 64, 3)


def _conv(width_in: int, width_out: int) -> list[nn.Module]:
    return [nn.ReflectionPad2d(1), nn.Conv2d(width_in, width_out, 3)]


def build_encoder() -> nn.Sequential:
    """VGG-19 (normalised) to relu4_1: 31 layers, indexed as in ``vgg_normalised.pth``."""
    layers: list[nn.Module] = [nn.Conv2d(3, 3, 1)]
    width = 3
    for item in _ENCODER:
        if item == "M":
            layers.append(nn.MaxPool2d(2, 2, ceil_mode=True))
        else:
            layers += _conv(width, item) + [nn.ReLU()]
            width = item
    return nn.Sequential(*layers)


def build_decoder() -> nn.Sequential:
    """The mirror of :func:`build_encoder`: 29 layers, indexed as in ``decoder.pth``."""
    layers: list[nn.Module] = []
    width = FEATURES
    for i, item in enumerate(_DECODER):
        if item == "U":
            layers.append(nn.Upsample(scale_factor=2, mode="nearest"))
        else:
            layers += _conv(width, item) + ([nn.ReLU()] if i < len(_DECODER) - 1 else [])
            width = item
    return nn.Sequential(*layers)


class StyleModel(nn.Module):
    """The AdaIN encoder and decoder, frozen, in evaluation mode."""

    def __init__(self, encoder: nn.Sequential, decoder: nn.Sequential):
        super().__init__()
        self.encoder, self.decoder = encoder, decoder
        self.requires_grad_(False)
        self.eval()

    @torch.no_grad()
    def stylize(self, images: torch.Tensor, style_mean: torch.Tensor, style_std: torch.Tensor,
                alpha: float = 1.0) -> torch.Tensor:
        """``images`` (N, 3, H, W) in [0, 1] carrying the styles (N, 512) ``style_mean``/``style_std``:
        decoder(alpha AdaIN(f) + (1 - alpha) f), f = encoder(images), at the input size (a decoder output of
        another size, for H or W not a multiple of 8, is resized bilinearly), not clamped."""
        features = self.encoder(images)
        moved = adain(features, style_mean, style_std)
        out = self.decoder(alpha * moved + (1 - alpha) * features)
        if out.shape[-2:] != images.shape[-2:]:
            out = nn.functional.interpolate(out, size=images.shape[-2:], mode="bilinear", align_corners=False)
        return out


def adain(features: torch.Tensor, style_mean: torch.Tensor, style_std: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) features with each image's channel statistics replaced by (N, C) ``style_mean``,
    ``style_std`` (module docstring)."""
    flat = features.flatten(2)
    mean = flat.mean(2)[..., None, None]
    std = (flat.var(2) + EPS).sqrt()[..., None, None]
    return (features - mean) / std * style_std[..., None, None] + style_mean[..., None, None]


def load_style_model(folder: str | Path, device: torch.device | str = "cpu") -> StyleModel:
    """The AdaIN encoder and decoder from ``folder``/``vgg_normalised.pth`` and ``folder``/``decoder.pth``;
    a missing or unfitting file is a one-line :class:`MpiflError`."""
    folder = Path(folder)
    encoder, decoder = build_encoder(), build_decoder()
    for network, name in ((encoder, ENCODER_FILE), (decoder, DECODER_FILE)):
        path = folder / name
        if not path.is_file():
            raise MpiflError(f"--style-model {folder}: no {name} there; CCST needs the AdaIN encoder "
                             f"({ENCODER_FILE}) and decoder ({DECODER_FILE}) of Huang & Belongie (ICCV 2017) in "
                             "that folder, copied from a machine with a network")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - any unreadable file is the user's to replace
            raise MpiflError(f"--style-model: cannot read {path} ({type(error).__name__}); replace the file") from None
        own = network.state_dict()
        if not isinstance(state, dict) or any(k not in state or tuple(state[k].shape) != tuple(v.shape)
                                              for k, v in own.items()):
            raise MpiflError(f"--style-model: {path} is not the AdaIN {name[:-4]} (its layers' names or shapes "
                             "differ); use the file the AdaIN code distributes")
        network.load_state_dict({k: state[k] for k in own})
    return StyleModel(encoder, decoder).to(device)


def save_random_style_model(folder: str | Path, seed: int = 0) -> Path:
    """Random AdaIN weights in the files :func:`load_style_model` reads, for runs without the published ones (the
    tests, ``launch/fingerprint.py``): He initialisation, zero biases and 0.5 on the output's, so that features
    and images keep their scale (torch's default initialisation shrinks the decoder's output to about 0: every
    stylization would be black)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for network, name in ((build_encoder(), ENCODER_FILE), (build_decoder(), DECODER_FILE)):
        convs = [m for m in network if isinstance(m, nn.Conv2d)]
        for conv in convs:
            nn.init.kaiming_normal_(conv.weight, nonlinearity="relu", generator=generator)
            nn.init.zeros_(conv.bias)
        if name == DECODER_FILE:
            nn.init.constant_(convs[-1].bias, 0.5)
        torch.save(network.state_dict(), folder / name)
    return folder
