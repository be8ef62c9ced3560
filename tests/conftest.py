"""Shared fixtures: every test takes `device`, so the suite runs on each device present
(CPU always, CUDA when torch sees a GPU and this build carries the CUDA kernels).

Tests of the optional features (masks, dropout, window, ALiBi, softcap, varlen) take
`feature_device`: the CUDA kernels do not have them yet (the ops refuse them on CUDA with a
NotImplementedError, tested in test_errors.py), so there the CUDA case is skipped with
that reason until CUDA_HAS_FEATURES is turned on."""
import pytest
import torch

import flashattn_ext

devices = ["cpu"]
if torch.cuda.is_available() and flashattn_ext.has_cuda_kernels():
    devices.append("cuda")

CUDA_HAS_FEATURES = False
feature_devices = [d if d == "cpu" or CUDA_HAS_FEATURES else
                   pytest.param(d, marks=pytest.mark.skip(reason="the optional features are CPU-only for now"))
                   for d in devices]


@pytest.fixture(params=devices)
def device(request):
    return request.param


@pytest.fixture(params=feature_devices)
def feature_device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
