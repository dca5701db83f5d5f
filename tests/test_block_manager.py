"""Unit specifications of the block pool and block manager (prefix caching, CoW, swap, errors)."""

from __future__ import annotations

import hashlib

import pytest

from jpaged.core.block_manager import BlockManager
from jpaged.core.block_pool import NULL_BLOCK, BlockPool, hash_block_tokens

BLOCK = 16


def prefill(manager: BlockManager, seq_id: int, tokens: list[int], cache_salt: str | None = None) -> int:
    """What the engine does for a new prompt: match, allocate the rest, compute, cache. Returns the hit."""
    hit = manager.match_prefix(seq_id, tokens, cache_salt)
    assert manager.allocate_slots(seq_id, hit, len(tokens) - hit)
    manager.cache_full_blocks(seq_id, tokens, len(tokens), cache_salt)
    return hit


def test_blocks_are_taken_as_the_sequence_grows_not_up_front():
    manager = BlockManager(num_blocks=10, block_size=4)
    assert manager.allocate_slots(1, 0, 5)
    assert len(manager.block_table(1)) == 2
    for computed in range(5, 8):
        assert manager.allocate_slots(1, computed, 1)
    assert len(manager.block_table(1)) == 2
    assert manager.allocate_slots(1, 8, 1)
    assert len(manager.block_table(1)) == 3
    assert manager.num_free_blocks == manager.num_total_blocks - 3


def test_null_block_is_never_handed_out():
    manager = BlockManager(num_blocks=5, block_size=1, enable_prefix_caching=False)
    assert manager.allocate_slots(1, 0, 4)
    assert NULL_BLOCK not in manager.block_table(1)
    assert manager.num_total_blocks == 4
    assert manager.usage == 1.0


def test_allocation_failure_changes_nothing():
    manager = BlockManager(num_blocks=4, block_size=4)
    assert manager.allocate_slots(1, 0, 8)
    assert not manager.allocate_slots(2, 0, 8)
    assert not manager.has_seq(2)
    assert manager.allocate_slots(1, 8, 4)
    table = manager.block_table(1)
    assert not manager.allocate_slots(1, 12, 1)
    assert manager.block_table(1) == table
    assert manager.num_free_blocks == 0


def test_prefix_hit_skips_shared_800_token_prefix():
    manager = BlockManager(num_blocks=200, block_size=BLOCK)
    system = list(range(1000, 1800))  # 800 tokens = 50 full blocks
    first = system + [1, 2, 3]
    second = system + [7, 8, 9, 10]
    assert prefill(manager, 1, first) == 0
    assert manager.match_prefix(2, second) == 800
    assert manager.block_table(2)[:50] == manager.block_table(1)[:50]
    assert manager.allocate_slots(2, 800, len(second) - 800)
    assert manager.prefix_cache_hits == 800
    assert manager.prefix_cache_queries == len(first) + len(second)


def test_prefix_hit_leaves_last_prompt_token_to_compute():
    manager = BlockManager(num_blocks=20, block_size=BLOCK)
    prompt = list(range(64))
    prefill(manager, 1, prompt)
    manager.free(1)
    assert manager.match_prefix(2, prompt) == 48


def test_prompt_differing_at_position_zero_shares_nothing():
    manager = BlockManager(num_blocks=20, block_size=BLOCK)
    prompt = list(range(100))
    prefill(manager, 1, prompt)
    assert manager.match_prefix(2, [999] + prompt[1:]) == 0
    assert manager.block_table(2) == []


def test_cache_salt_isolates_tenants():
    manager = BlockManager(num_blocks=20, block_size=BLOCK)
    prompt = list(range(100))
    prefill(manager, 1, prompt, cache_salt="tenant-a")
    assert manager.match_prefix(2, prompt, cache_salt="tenant-b") == 0
    assert manager.match_prefix(3, prompt) == 0
    assert manager.match_prefix(4, prompt, cache_salt="tenant-a") == 96


def test_prefix_caching_off_never_hits():
    manager = BlockManager(num_blocks=20, block_size=BLOCK, enable_prefix_caching=False)
    prompt = list(range(100))
    prefill(manager, 1, prompt)
    assert manager.match_prefix(2, prompt) == 0
    assert manager.prefix_cache_queries == 0


def test_freed_full_blocks_stay_hittable_and_count_as_free():
    manager = BlockManager(num_blocks=10, block_size=4)
    prefill(manager, 1, list(range(9)))  # two full blocks + one partial
    manager.free(1)
    assert manager.num_free_blocks == manager.num_total_blocks
    assert manager.usage == 0.0
    assert manager.match_prefix(2, list(range(9))) == 8
    assert manager.num_free_blocks == manager.num_total_blocks - 2


def test_eviction_takes_least_recently_freed_cached_block_first():
    manager = BlockManager(num_blocks=4, block_size=4)  # 3 usable blocks
    prompts = {seq_id: [seq_id * 100 + i for i in range(5)] for seq_id in (1, 2, 3)}
    for seq_id in (1, 2, 3):
        prefill(manager, seq_id, prompts[seq_id][:4])
        manager.free(seq_id)
    # Reusing prompt 1 makes it the most recently used once freed again.
    assert manager.match_prefix(4, prompts[1]) == 4
    manager.free(4)
    assert manager.allocate_slots(5, 0, 4)  # evicts prompt 2's block, the least recently freed
    assert manager.match_prefix(6, prompts[2]) == 0
    assert manager.match_prefix(7, prompts[3]) == 4
    assert manager.match_prefix(8, prompts[1]) == 4


def test_fork_copies_shared_partial_block_on_write():
    manager = BlockManager(num_blocks=10, block_size=4)
    prefill(manager, 1, list(range(6)))  # one full block, one partial
    manager.fork(1, 2)
    parent_table = manager.block_table(1)
    assert manager.block_table(2) == parent_table
    assert [manager.pool.refcount(b) for b in parent_table] == [2, 2]
    assert manager.allocate_slots(2, 6, 1)
    child_table = manager.block_table(2)
    assert child_table[0] == parent_table[0]
    assert child_table[1] != parent_table[1]
    assert manager.take_pending_copies() == [(parent_table[1], child_table[1])]
    assert manager.take_pending_copies() == []
    assert [manager.pool.refcount(b) for b in child_table] == [2, 1]
    assert manager.pool.refcount(parent_table[1]) == 1
    assert manager.allocate_slots(1, 6, 1)  # the parent now owns its block alone: no copy
    assert manager.take_pending_copies() == []


def test_block_tables_array_follows_growth_copy_on_write_swap_and_free():
    manager = BlockManager(num_blocks=400, block_size=2, num_swap_blocks=40)
    for seq_id in range(70):  # more sequences than the array's first rows
        assert manager.allocate_slots(seq_id, 0, 3)
    assert manager.allocate_slots(0, 3, 40)  # 22 blocks: wider than its first columns
    manager.fork(1, 100)
    assert manager.allocate_slots(100, 3, 1)  # copy-on-write replaces the shared partial block
    manager.swap_out(2)
    manager.free(3)
    assert manager.allocate_slots(200, 0, 1)  # may reuse the freed sequence's row
    seq_ids = [0, 1, 100, 2, 200, 69]
    for seq_id, row in zip(seq_ids, manager.block_tables(seq_ids), strict=True):
        table = [] if seq_id == 2 else manager.block_table(seq_id)  # swapped out: no device blocks
        assert list(row[: len(table)]) == table and not row[len(table) :].any()


def test_copy_on_write_needs_a_free_block():
    manager = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    assert manager.allocate_slots(1, 0, 6)
    manager.fork(1, 2)
    assert not manager.allocate_slots(2, 6, 1)
    assert manager.take_pending_copies() == []


def test_swap_out_and_in_moves_blocks_through_host_slots():
    manager = BlockManager(num_blocks=6, block_size=4, num_swap_blocks=3)
    assert manager.allocate_slots(1, 0, 10)
    table = manager.block_table(1)
    assert manager.can_swap_out(1)
    out = manager.swap_out(1)
    assert [block for block, _ in out] == table
    assert manager.num_free_blocks == manager.num_total_blocks
    assert manager.num_free_host_slots == 0
    with pytest.raises(ValueError, match="swapped out"):
        manager.block_table(1)
    assert manager.can_swap_in(1)
    back = manager.swap_in(1)
    assert [slot for slot, _ in back] == [slot for _, slot in out]
    assert manager.block_table(1) == [block for _, block in back]
    assert (manager.num_swapped_out_blocks, manager.num_swapped_in_blocks) == (3, 3)
    assert manager.num_free_host_slots == 3


def test_swap_out_needs_enough_host_slots():
    manager = BlockManager(num_blocks=6, block_size=4, num_swap_blocks=2)
    assert manager.allocate_slots(1, 0, 10)
    assert not manager.can_swap_out(1)
    with pytest.raises(ValueError, match="can_swap_out"):
        manager.swap_out(1)


def test_swap_out_of_a_block_copied_this_step_reads_the_copy_source():
    manager = BlockManager(num_blocks=8, block_size=4, num_swap_blocks=4)
    assert manager.allocate_slots(1, 0, 6)
    manager.fork(1, 2)
    assert manager.allocate_slots(2, 6, 1)
    source = manager.block_table(1)[1]
    assert [block for block, _ in manager.swap_out(2)][1] == source


def test_reset_prefix_cache_forgets_unreferenced_blocks():
    manager = BlockManager(num_blocks=10, block_size=4)
    prefill(manager, 1, list(range(9)))
    prefill(manager, 2, list(range(50, 59)))
    manager.free(1)
    assert not manager.reset_prefix_cache()  # seq 2 still holds its cached blocks
    assert manager.match_prefix(3, list(range(9))) == 0
    manager.free(2)
    manager.free(3)
    assert manager.reset_prefix_cache()
    assert manager.match_prefix(4, list(range(50, 59))) == 0
    assert manager.num_free_blocks == manager.num_total_blocks


def test_duplicate_content_keeps_the_first_cached_block():
    manager = BlockManager(num_blocks=10, block_size=4)
    prompt = list(range(5))
    assert manager.allocate_slots(1, 0, 5)
    assert manager.allocate_slots(2, 0, 5)
    manager.cache_full_blocks(1, prompt, 5)
    manager.cache_full_blocks(2, prompt, 5)
    assert manager.match_prefix(3, prompt) == 4
    assert manager.block_table(3) == manager.block_table(1)[:1]
    manager.free(2)
    assert manager.num_free_blocks == manager.num_total_blocks - 2


def test_block_hash_is_sha256_of_a_stable_encoding():
    first = hash_block_tokens(None, [1, 2, 3])
    assert first == hash_block_tokens(None, [1, 2, 3])
    assert len(first) == hashlib.sha256().digest_size
    assert first != hash_block_tokens(None, [1, 2, 4])
    assert first != hash_block_tokens(first, [1, 2, 3])
    assert hash_block_tokens(None, [1, 2], ["a"]) != hash_block_tokens(None, [1, 2], ["b"])
    assert hash_block_tokens(None, [1, 23]) != hash_block_tokens(None, [12, 3])


def test_engine_bugs_are_loud():
    manager = BlockManager(num_blocks=10, block_size=4)
    with pytest.raises(KeyError, match="seq_id 9"):
        manager.free(9)
    with pytest.raises(KeyError, match="seq_id 9"):
        manager.block_table(9)
    with pytest.raises(KeyError, match="seq_id 9"):
        manager.allocate_slots(9, 4, 1)
    prefill(manager, 1, list(range(9)))
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.match_prefix(1, list(range(9)))
    with pytest.raises(ValueError, match="already exists"):
        manager.fork(1, 1)
    with pytest.raises(ValueError, match="overwrite cached"):
        manager.allocate_slots(1, 4, 1)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(1, 9, -1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_blocks": 1}, "num_blocks"),
        ({"num_blocks": 4, "block_size": 0}, "block_size"),
        ({"num_blocks": 4, "num_swap_blocks": -1}, "num_swap_blocks"),
    ],
)
def test_bad_configuration_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BlockManager(**kwargs)


def test_pool_refuses_to_revive_a_free_block():
    pool = BlockPool(4)
    block = pool.allocate()
    pool.decref(block)
    with pytest.raises(ValueError, match="free"):
        pool.incref(block)
