"""Construct modules without running their random initialisation.

Checkpoint weights overwrite every parameter, so random init would only cost time (seconds
for billion-parameter models). Unlike `torch.nn.utils.skip_init`, the storage lands on the
current default device, so `with torch.device("cuda"): Model(...)` builds on the GPU.
"""
from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

M = TypeVar("M", bound=nn.Module)


def uninitialized(module_cls: type[M], *args, **kwargs) -> M:
    """`module_cls(*args, **kwargs)` with uninitialised storage on the default device."""
    return module_cls(*args, device="meta", **kwargs).to_empty(device=torch.get_default_device())
