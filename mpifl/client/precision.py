"""``--precision fp32|bf16|fp16`` and ``--channels-last``: how a client rank computes.

bf16 and fp16 run the forward pass (and the loss) under ``torch.autocast``;
parameters, gradients and the optimizer stay fp32, so every method's
arithmetic on weights (proximal terms, control variates, aggregation) is
unchanged.  fp16 also scales the loss (``torch.amp.GradScaler``); gradients
are unscaled *before* the method's ``after_backward`` corrections, so those
corrections see true gradients, and a step whose gradients overflowed is
skipped by the scaler as usual.  bf16 needs no scaling.  ``channels_last``
stores conv weights and inputs NHWC, which tensor cores prefer.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast and loss scaling for one device."""

    def __init__(self, name: str, device: torch.device, channels_last: bool = False):
        self.dtype = PRECISIONS[name]
        self.device = device
        self.channels_last = channels_last
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last and x.dim() == 4 else x

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """``loss.backward()``, leaving true (unscaled) gradients for the method's corrections."""
        if self.scaler is None:
            loss.backward()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()


FP32 = Precision("fp32", torch.device("cpu"))
