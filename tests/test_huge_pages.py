"""KV cache tensors on transparent huge pages (carpool/model/huge_pages.py)."""
from __future__ import annotations

import sys

import pytest
import torch

from carpool.model import huge_pages


@pytest.mark.parametrize("shape", [(3, 2900, 64, 16), (2, 5, 7)])
def test_zeros_is_a_zeroed_contiguous_tensor(shape: tuple[int, ...]) -> None:
    tensor = huge_pages.zeros(shape, torch.bfloat16)
    assert tensor.shape == shape and tensor.dtype == torch.bfloat16
    assert tensor.is_contiguous() and not tensor.any()
    tensor.view(-1)[-1] = 3.0  # the whole extent is writable
    assert tensor.sum().item() == 3.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked for on Linux only")
def test_large_tensors_start_on_a_huge_page_boundary() -> None:
    tensor = huge_pages.zeros((4, 1 << 20), torch.float16)  # 8 MiB
    assert tensor.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0

