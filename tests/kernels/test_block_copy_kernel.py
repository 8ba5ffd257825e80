"""copy_staged_blocks: the kernel against its reference (engine.worker.layers), over pairs
the device holds; on CUDA also replayed from one graph as the count changes."""
import pytest
import torch

from engine.worker.block_copy import allocate_kv_caches, kv_storage
from engine.worker.layers import copy_staged_blocks as reference
from kernel_cases import DEVICE, DTYPES, HEAD_DIM, INTERPRET, NUM_HEADS
from kernels.block_copy import copy_staged_blocks

BLOCK_SIZE = 16
NUM_BLOCKS = 12
MAX_PAIRS = 5


def random_storage(dtype: torch.dtype) -> torch.Tensor:
    caches = allocate_kv_caches(3, (BLOCK_SIZE, NUM_HEADS, HEAD_DIM), NUM_BLOCKS, dtype,
                                torch.device(DEVICE))
    storage = kv_storage(caches)
    return storage.copy_(torch.randn(storage.shape, device=DEVICE).to(dtype))


def staged(copies: list[tuple[int, int]]) -> torch.Tensor:
    """[n, sources padded to MAX_PAIRS, destinations padded]; padding entries are junk."""
    pairs = torch.full((1 + 2 * MAX_PAIRS,), 10 ** 6, dtype=torch.int64)
    pairs[0] = len(copies)
    for i, (src, dst) in enumerate(copies):
        pairs[1 + i], pairs[1 + MAX_PAIRS + i] = src, dst
    return pairs.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("copies", [[], [(3, 7)], [(1, 6), (1, 2), (5, 0), (11, 10)]])
def test_copies_pairs_up_to_the_device_count_in_every_cache(dtype, copies):
    storage = random_storage(dtype)
    expected = storage.clone()
    reference(expected, staged(copies))
    original = storage.clone()
    copy_staged_blocks(storage, staged(copies))
    assert torch.equal(storage, expected)
    sources = dict((dst, src) for src, dst in copies)
    for block in range(NUM_BLOCKS):  # the reference itself: dst from src, the rest untouched
        assert torch.equal(expected[:, :, block], original[:, :, sources.get(block, block)])


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs")
def test_one_graph_serves_any_count():
    storage = random_storage(torch.float16)
    pairs = staged([])
    copy_staged_blocks(storage, pairs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_staged_blocks(storage, pairs)
    for copies in ([(2, 9)], [(0, 4), (8, 3), (7, 1)], []):
        expected = storage.clone()
        reference(expected, staged(copies))
        pairs.copy_(staged(copies))
        graph.replay()
        assert torch.equal(storage, expected)
