"""The AdaIN network CCST stylizes with: its layers as the distributed weight files index them, the AdaIN
statistics by hand, and one-line refusals of missing or foreign weights."""

import pytest
import torch

from mpifl.errors import MpiflError
from mpifl.models.adain import (DECODER_FILE, ENCODER_FILE, adain, build_decoder, build_encoder,
                                load_style_model)


def _full_vgg_state() -> dict:
    """A state dict shaped like the distributed ``vgg_normalised.pth``: VGG-19 to relu5_4, 53 layers, of
    which the 31 up to relu4_1 are CCST's encoder."""
    state = {k: torch.randn(v.shape) for k, v in build_encoder().state_dict().items()}
    for index in (32, 35, 38, 42, 45, 48, 51):  # relu4_2 ... relu5_4: 3 x 3 convolutions, 512 -> 512
        state[f"{index}.weight"], state[f"{index}.bias"] = torch.randn(512, 512, 3, 3), torch.randn(512)
    return state


def test_encoder_and_decoder_have_the_distributed_files_layer_indices_and_shapes():
    encoder, decoder = build_encoder(), build_decoder()
    assert len(encoder) == 31 and len(decoder) == 29
    convs = {k: tuple(v.shape) for k, v in encoder.state_dict().items() if k.endswith("weight")}
    assert convs["0.weight"] == (3, 3, 1, 1) and convs["2.weight"] == (64, 3, 3, 3)
    assert convs["29.weight"] == (512, 256, 3, 3) and isinstance(encoder[30], torch.nn.ReLU)
    assert [i for i, m in enumerate(encoder) if isinstance(m, torch.nn.MaxPool2d)] == [7, 14, 27]
    assert [i for i, m in enumerate(decoder) if isinstance(m, torch.nn.Upsample)] == [3, 16, 23]
    assert tuple(decoder[1].weight.shape) == (256, 512, 3, 3) and tuple(decoder[28].weight.shape) == (3, 64, 3, 3)
    assert isinstance(decoder[27], torch.nn.ReflectionPad2d)  # no ReLU after the last convolution
    x = torch.rand(2, 3, 28, 28)
    features = encoder(x)
    assert features.shape == (2, 512, 4, 4)  # 28 -> 14 -> 7 -> 4 (ceil_mode)
    assert decoder(features).shape == (2, 3, 32, 32)


def test_adain_moves_each_images_channel_statistics_to_the_style_by_hand():
    features = torch.tensor([1.0, 2.0, 3.0, 4.0, 2.0, 2.0, 2.0, 6.0]).reshape(1, 2, 2, 2)
    out = adain(features, torch.tensor([[10.0, -1.0]]), torch.tensor([[2.0, 0.5]]))
    # channel 0: mean 2.5, unbiased variance 5/3; channel 1: mean 3, unbiased variance 4
    expected0 = (torch.tensor([1.0, 2.0, 3.0, 4.0]) - 2.5) / (5 / 3 + 1e-5) ** 0.5 * 2 + 10
    expected1 = (torch.tensor([2.0, 2.0, 2.0, 6.0]) - 3.0) / (4 + 1e-5) ** 0.5 * 0.5 - 1
    assert torch.allclose(out[0, 0].flatten(), expected0, atol=1e-6)
    assert torch.allclose(out[0, 1].flatten(), expected1, atol=1e-6)


def test_the_authors_files_load_and_only_the_layers_to_relu4_1_are_used(tmp_path):
    vgg, dec = _full_vgg_state(), {k: torch.randn(v.shape) for k, v in build_decoder().state_dict().items()}
    torch.save(vgg, tmp_path / ENCODER_FILE)
    torch.save(dec, tmp_path / DECODER_FILE)
    model = load_style_model(tmp_path)
    assert torch.equal(model.encoder[29].weight, vgg["29.weight"]) and torch.equal(model.decoder[28].bias, dec["28.bias"])
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    images = torch.rand(2, 3, 30, 30)
    style = model.stylize(images, torch.zeros(2, 512), torch.ones(2, 512))
    assert style.shape == images.shape  # 30 is not a multiple of 8: resized back to the input size


def test_missing_or_foreign_weights_are_one_line(tmp_path):
    with pytest.raises(MpiflError, match=rf"^--style-model {tmp_path}: no {ENCODER_FILE} there; CCST needs"):
        load_style_model(tmp_path)
    torch.save(build_encoder().state_dict(), tmp_path / ENCODER_FILE)
    torch.save({"0.weight": torch.zeros(1)}, tmp_path / DECODER_FILE)
    with pytest.raises(MpiflError, match=r"is not the AdaIN decoder \(its layers' names or shapes differ\)"):
        load_style_model(tmp_path)
    (tmp_path / DECODER_FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(MpiflError, match=r"^--style-model: cannot read .*decoder.pth \(\w+\); replace the file$"):
        load_style_model(tmp_path)
