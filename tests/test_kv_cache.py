"""Page-pool bookkeeping: allocation, growth across page boundaries, the speculative transaction,
freeing and exhaustion."""

import pytest

from specbench.engine.kv_cache import KVCacheError, PagePool, pages_for


def test_growth_across_page_boundaries_and_slots():
    pool = PagePool(num_pages=8, page_size=4)
    pool.admit("a", 20)
    pool.ensure("a", 3)
    assert len(pool.table("a")) == 1 and pool.num_free == 7
    pool.ensure("a", 4)
    assert len(pool.table("a")) == 1  # exactly one full page
    pool.ensure("a", 5)
    assert len(pool.table("a")) == 2  # crossed the boundary
    t = pool.table("a")
    assert pool.slot("a", 0) == t[0] * 4 and pool.slot("a", 4) == t[1] * 4
    assert pool.slots("a", 3, 6) == [t[0] * 4 + 3, t[1] * 4, t[1] * 4 + 1]
    pool.check()


def test_speculative_reserve_commit_rollback_returns_pages():
    pool = PagePool(num_pages=16, page_size=4)
    pool.admit("a", 60)
    pool.ensure("a", 6)
    pool.commit("a", 6)
    start_free = pool.num_free
    pool.reserve("a", 16)  # a verify span of 16 past 6 committed tokens -> capacity 22 (6 pages)
    assert pool.capacity("a") >= 22
    pool.commit("a", 6 + 3)  # accepted 2 drafts + bonus row kept
    assert pool.capacity("a") == pages_for(9, 4) * 4
    assert pool.num_free == start_free - (pages_for(9, 4) - pages_for(6, 4))
    pool.commit("a", 6)  # a full rollback
    assert pool.num_free == start_free
    pool.check()


def test_leak_fault_loses_pages():
    pool = PagePool(num_pages=8, page_size=4)
    pool.admit("a", 30)
    pool.reserve("a", 12)
    pool.commit("a", 1, leak=True)
    pool.free("a")
    assert pool.num_free < 8
    with pytest.raises(KVCacheError):
        pool.check()


def test_free_and_admission_budget():
    pool = PagePool(num_pages=10, page_size=4)
    assert pool.can_admit(40) and not pool.can_admit(41)
    pool.admit("a", 24)  # promises 6 pages, takes none yet
    assert pool.num_free == 10
    assert pool.can_admit(16) and not pool.can_admit(17)  # 4 pages left unpromised
    pool.ensure("a", 24)
    assert pool.num_free == 4
    pool.free("a")
    assert pool.num_free == 10 and "a" not in pool
    pool.check()


def test_exhaustion_is_an_error_not_a_hang():
    pool = PagePool(num_pages=2, page_size=4)
    pool.admit("a", 8)
    with pytest.raises(KVCacheError, match="pool exhausted"):
        pool.ensure("a", 9)
    with pytest.raises(KVCacheError):
        pool.admit("b", 4)  # a is promised every page
    assert not pool.fits_ever(9)
    with pytest.raises(KVCacheError, match="num_pages"):
        PagePool(0, 4)
