"""`StagedUpload`: a step's index arrays sent in one copy per dtype (CPU here; the engine's GPU tests
run its CUDA path)."""

import numpy as np
import pytest
import torch

from unipage.staging import ALIGN, StagedUpload


def test_sends_mixed_dtypes_shapes_and_empty_arrays_unchanged():
    arrays = [np.arange(5, dtype=np.int64), np.arange(12, dtype=np.int32).reshape(3, 4),
              np.zeros(0, dtype=np.int64), np.array([-1, 7], dtype=np.int32)]
    sent = StagedUpload(torch.device("cpu")).send(arrays)
    for got, want in zip(sent, arrays):
        assert got.dtype == {np.int64: torch.int64, np.int32: torch.int32}[want.dtype.type]
        assert tuple(got.shape) == want.shape and np.array_equal(got.numpy(), want)


def test_refuses_other_dtypes():
    with pytest.raises(TypeError, match="int32 or int64"):
        StagedUpload(torch.device("cpu")).send([np.zeros(3, dtype=np.float32)])


@pytest.mark.gpu
def test_cuda_arrays_are_aligned_views_and_the_buffer_grows():
    upload = StagedUpload(torch.device("cuda"))
    small = [np.arange(3, dtype=np.int64), np.arange(5, dtype=np.int32), np.arange(7, dtype=np.int64)]
    big = [np.arange(10_000, dtype=np.int64), np.arange(6, dtype=np.int32).reshape(2, 3)]
    for arrays in (small, big, small):
        sent = upload.send(arrays)
        for got, want in zip(sent, arrays):
            assert got.is_cuda and got.data_ptr() % (ALIGN * got.element_size()) == 0
            assert np.array_equal(got.cpu().numpy(), want)
