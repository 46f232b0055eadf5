import pytest

from fd.engine.core.block_manager import BlockManager, DoubleFree, NoFreeBlocks


def test_allocate_and_free_return_blocks_to_the_pool():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert (bm.num_free, bm.num_total) == (8, 8)
    a = bm.allocate("a", 3)
    b = bm.allocate("b", 2)
    assert len(set(a) | set(b)) == 5
    assert bm.table("a") == tuple(a) and bm.num_held("b") == 2
    assert bm.num_free == 3
    assert all(bm.refs(x) == 1 for x in a)
    assert bm.free("a") == 3
    assert bm.num_free == 6 and not bm.owns("a") and bm.table("a") == ()
    assert all(bm.refs(x) == 0 for x in a)
    bm.check()


def test_ensure_grows_on_demand_by_token_count():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert len(bm.ensure("a", 1)) == 1
    assert bm.ensure("a", 4) == []  # still fits the first block
    assert len(bm.ensure("a", 5)) == 1
    assert len(bm.ensure("a", 13)) == 2
    assert bm.num_held("a") == 4 and bm.num_free == 4
    assert bm.blocks_for(0) == 0 and bm.blocks_for(4) == 1 and bm.blocks_for(9) == 3


def test_double_free_raises_and_leaves_pool_intact():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 2)
    bm.free("a")
    with pytest.raises(DoubleFree):
        bm.free("a")
    with pytest.raises(DoubleFree):
        bm.free("never")
    assert bm.num_free == 4
    bm.check()


def test_exhaustion_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 3)
    assert bm.shortfall("b", 4) == 1  # needs 2 blocks, 1 free
    with pytest.raises(NoFreeBlocks):
        bm.allocate("b", 2)
    with pytest.raises(NoFreeBlocks):
        bm.ensure("a", 9)  # 5 blocks
    assert bm.num_free == 1 and bm.num_held("a") == 3 and not bm.owns("b")
    bm.allocate("b", 1)
    assert bm.num_free == 0
    bm.check()


def test_allocation_order_is_deterministic_fifo():
    bm = BlockManager(num_blocks=4, block_size=2)
    assert bm.allocate("a", 2) == [0, 1]
    assert bm.allocate("b", 1) == [2]
    bm.free("a")
    # freed blocks queue behind the never-used one, a table's tail first
    assert bm.allocate("c", 3) == [3, 1, 0]


def test_check_detects_a_corrupted_pool():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a", 1)
    bm._free[bm.table("a")[0]] = None  # simulate a bug: a held block put back on the free list
    with pytest.raises(AssertionError):
        bm.check()


def test_cached_blocks_are_shared_read_only_and_evicted_only_for_new_contents():
    from fd.control.prefix import block_hash

    bm = BlockManager(num_blocks=4, block_size=2)
    h0 = block_hash(b"", [1, 2])
    h1 = block_hash(h0, [3, 4])
    assert block_hash(b"", [3, 4]) != h1  # the same tokens after another prefix: other contents
    a = bm.allocate("a", 3)
    assert bm.lookup([h0, h1]) == []
    bm.register("a", 0, h0)
    bm.register("a", 1, h1)
    assert bm.lookup([h0, h1, block_hash(h1, [5, 6])]) == a[:2] and bm.num_cached == 2
    bm.acquire("b", a[:2])  # shared while a holds them
    assert [bm.refs(x) for x in a] == [2, 2, 1] and bm.num_free == 1
    bm.register("b", 0, h0)  # already cached elsewhere (or here): nothing changes
    assert bm.free("a") == 3 and [bm.refs(x) for x in a] == [1, 1, 0] and bm.num_free == 2
    assert bm.free("b") == 2 and bm.num_free == 4  # free, and still cached
    assert bm.lookup([h0, h1]) == a[:2]
    bm.acquire("c", bm.lookup([h0]))  # a cached free block leaves the free list while held
    assert bm.num_free == 3
    bm.check()
    # the free list hands out the oldest-freed first; a cached block it hands out is evicted
    got = bm.allocate("d", 3)
    assert a[1] in got and bm.lookup([h0, h1]) == [a[0]] and bm.num_cached == 1
    bm.check()
    bm.free("c")
    bm.free("d")
    assert bm.num_free == 4
    bm.check()
