"""copy_blocks: each pair's dst block becomes its src block in every layer's K and V, and
nothing else changes."""
import pytest
import torch

from engine.worker.block_copy import allocate_kv_caches, copy_blocks


def test_copies_every_layers_k_and_v_and_nothing_else():
    caches = allocate_kv_caches(3, (4, 2, 5), 8, torch.float32, torch.device("cpu"))
    for cache in (c for layer in caches for c in layer):
        cache.copy_(torch.randn_like(cache))
    before = [(k.clone(), v.clone()) for k, v in caches]
    copy_blocks(caches, ((1, 6), (1, 2), (5, 0)))
    expected_source = {6: 1, 2: 1, 0: 5}
    for (k, v), (k0, v0) in zip(caches, before):
        for new, old in ((k, k0), (v, v0)):
            for block in range(8):
                assert torch.equal(new[block], old[expected_source.get(block, block)])


def test_caches_are_views_of_one_zeroed_storage():
    caches = allocate_kv_caches(2, (4, 2, 5), 3, torch.float16, torch.device("cpu"))
    storage = caches[0][0]._base
    assert all(c._base is storage for layer in caches for c in layer)
    assert storage.shape == (2, 2, 3, 4, 2, 5) and not storage.any()
    assert all(c.is_contiguous() for layer in caches for c in layer)


def test_caches_allocated_apart_are_refused():
    caches = [(torch.zeros(3, 4), torch.zeros(3, 4))]
    with pytest.raises(ValueError, match="allocate_kv_caches"):
        copy_blocks(caches, ((0, 1),))


def test_the_block_copy_graph_copies_each_steps_pairs_as_copy_blocks():
    """BlockCopyGraph stages each step's pairs (fewer or more than the last step's) into the
    one buffer its graph reads: each replay copies as copy_blocks does."""
    from eager_graphs import replay_block_copy_eagerly
    from engine.worker.block_copy import kv_storage
    from engine.worker.cuda_graphs import BlockCopyGraph
    from engine.worker.layers import copy_staged_blocks

    caches = allocate_kv_caches(2, (4, 2, 5), 10, torch.float32, torch.device("cpu"))
    storage = kv_storage(caches).copy_(torch.randn(kv_storage(caches).shape))
    graph = BlockCopyGraph(copy_staged_blocks, storage, max_pairs=4)
    replay_block_copy_eagerly(graph)
    expected = allocate_kv_caches(2, (4, 2, 5), 10, torch.float32, torch.device("cpu"))
    kv_storage(expected).copy_(storage)
    for copies in (((1, 6), (1, 2), (5, 0), (3, 4)), ((7, 8),), ((9, 1), (2, 3))):
        assert graph.takes(storage, copies)
        copy_blocks(expected, copies)
        graph.run(copies)
        assert all(torch.equal(k, ek) and torch.equal(v, ev)
                   for (k, v), (ek, ev) in zip(caches, expected))
    assert graph.steps_copied == 3
    assert not graph.takes(storage, ((0, 1),) * 5)
    assert not graph.takes(storage.clone(), ((0, 1),))
