"""Shared fixtures: every test takes `device`, so the suite runs on each device present
(CPU always, CUDA when torch sees a GPU and this build carries the CUDA kernels)."""
import pytest
import torch

import flashattn_ext

devices = ["cpu"]
if torch.cuda.is_available() and flashattn_ext.has_cuda_kernels():
    devices.append("cuda")


@pytest.fixture(params=devices)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
