import pytest

from engine.block_manager import BlockManager, DoubleFree, NoFreeBlocks


def test_allocate_and_free_return_blocks_to_the_pool():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert (bm.num_free, bm.num_total) == (8, 8)
    a = bm.allocate("a", 3)
    b = bm.allocate("b", 2)
    assert len(set(a) | set(b)) == 5
    assert bm.table("a") == tuple(a) and bm.num_held("b") == 2
    assert bm.num_free == 3
    assert all(bm.owner(x) == "a" for x in a)
    assert bm.free("a") == 3
    assert bm.num_free == 6 and not bm.owns("a") and bm.table("a") == ()
    assert all(bm.owner(x) is None for x in a)
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
    # freed blocks queue behind the never-used one
    assert bm.allocate("c", 3) == [3, 0, 1]


def test_check_detects_a_corrupted_pool():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a", 1)
    bm._free.append(bm.table("a")[0])  # simulate a bug: a held block put back on the free list
    with pytest.raises(AssertionError):
        bm.check()
