"""Property test: random interleavings of the engine's block-manager calls keep every invariant.

The machine mirrors the KV cache as token ids per block (`device`, `host`), applies the transfers the manager
records (CoW copies, swaps) and the writes each step makes, then checks after every step that every sequence still
reads back exactly its own tokens and that the pool's bookkeeping is exact.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jpaged.core.block_manager import BlockManager
from jpaged.core.block_pool import NULL_BLOCK, BlockHash, hash_block_tokens

BLOCK_SIZE = 4
NUM_BLOCKS = 17  # 16 usable: small enough that allocation fails and cached blocks get evicted
NUM_SWAP_BLOCKS = 8
FAMILIES = [[family * 1000 + i for i in range(20)] for family in range(3)]  # shared prompt prefixes


@dataclass
class SeqModel:
    tokens: list[int]  # prompt plus sampled tokens; the last ones may not be written yet
    computed: int  # tokens written to the cache
    salt: str | None


def ceil_blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE, num_swap_blocks=NUM_SWAP_BLOCKS)
        self.running: dict[int, SeqModel] = {}
        self.swapped: dict[int, SeqModel] = {}
        self.preempted: list[SeqModel] = []  # waiting to be recomputed
        self.device: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}
        self.host_slots: dict[int, list[int]] = {}  # swapped seq -> its host slots, in block order
        self.known_hashes: dict[BlockHash, tuple[int, ...]] = {}  # hash -> the block's tokens
        self.next_seq_id = 0

    def _admit(self, seq: SeqModel) -> None:
        seq_id = self.next_seq_id
        self.next_seq_id += 1
        hit = self.manager.match_prefix(seq_id, seq.tokens, seq.salt)
        assert hit % BLOCK_SIZE == 0 and hit <= len(seq.tokens) - 1
        assert len(self.manager.block_table(seq_id)) == hit // BLOCK_SIZE
        seq.computed = hit
        event("prefix hit" if hit else "prefix miss")
        self.running[seq_id] = seq

    @rule(
        family=st.integers(0, len(FAMILIES) - 1),
        prefix_len=st.integers(0, 20),
        tail=st.lists(st.integers(0, 9), max_size=6),
        salt=st.sampled_from([None, "tenant"]),
    )
    def new_request(self, family: int, prefix_len: int, tail: list[int], salt: str | None) -> None:
        prompt = FAMILIES[family][:prefix_len] + tail
        if prompt:
            self._admit(SeqModel(prompt, 0, salt))

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def resume_preempted(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.preempted) - 1))
        self._admit(self.preempted.pop(index))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One engine step: every running sequence computes a prefill chunk or appends one sampled token."""
        for seq_id in sorted(self.running):
            chunk = data.draw(st.integers(1, 8), label="chunk")
            self._advance(seq_id, chunk, sampled=data.draw(st.integers(0, 50), label="sampled"))

    def _advance(self, seq_id: int, chunk: int, sampled: int) -> None:
        seq = self.running[seq_id]
        if seq.computed == len(seq.tokens):
            seq.tokens.append(sampled)
        num_new = min(chunk, len(seq.tokens) - seq.computed)
        table_before = self.manager.block_table(seq_id)
        free_before = self.manager.num_free_blocks
        evictable_before = len(self.manager.pool.evictable_blocks())
        if not self.manager.allocate_slots(seq_id, seq.computed, num_new):
            assert self.manager.block_table(seq_id) == table_before
            assert self.manager.num_free_blocks == free_before
            assert self.manager.take_pending_copies() == []
            event("allocation refused")
            return
        if len(self.manager.pool.evictable_blocks()) < evictable_before:
            event("evicted a cached block")
        for src, dst in self.manager.take_pending_copies():
            event("copy-on-write")
            self.device[dst] = list(self.device[src])
        table = self.manager.block_table(seq_id)
        for position in range(seq.computed, seq.computed + num_new):
            block_id = table[position // BLOCK_SIZE]
            assert self.manager.pool.refcount(block_id) == 1, "a shared block would be written"
            assert self.manager.pool.block_hash(block_id) is None, "a cached block would be written"
            self.device.setdefault(block_id, [None] * BLOCK_SIZE)[position % BLOCK_SIZE] = seq.tokens[
                position
            ]
        seq.computed += num_new
        self.manager.cache_full_blocks(seq_id, seq.tokens, seq.computed, seq.salt)
        self._learn_hashes(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent_id = data.draw(st.sampled_from(sorted(self.running)))
        parent = self.running[parent_id]
        child_id = self.next_seq_id
        self.next_seq_id += 1
        self.manager.fork(parent_id, child_id)
        self.running[child_id] = SeqModel(list(parent.tokens), parent.computed, parent.salt)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), recompute=st.booleans())
    def finish_or_preempt(self, data: st.DataObject, recompute: bool) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.running)))
        seq = self.running.pop(seq_id)
        self.manager.free(seq_id)
        if recompute:
            self.preempted.append(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.running)))
        if not self.manager.can_swap_out(seq_id):
            assert self.manager.num_free_host_slots < ceil_blocks(self.running[seq_id].computed)
            return
        table = self.manager.block_table(seq_id)
        transfers = self.manager.swap_out(seq_id)
        assert [block_id for block_id, _ in transfers] == table
        for block_id, slot in transfers:
            self.host[slot] = list(self.device[block_id])
        self.host_slots[seq_id] = [slot for _, slot in transfers]
        event("swapped out")
        self.swapped[seq_id] = self.running.pop(seq_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        if not self.manager.can_swap_in(seq_id):
            assert self.manager.num_free_blocks < ceil_blocks(self.swapped[seq_id].computed)
            return
        transfers = self.manager.swap_in(seq_id)
        assert [slot for slot, _ in transfers] == self.host_slots.pop(seq_id)
        assert [block_id for _, block_id in transfers] == self.manager.block_table(seq_id)
        for slot, block_id in transfers:
            self.device[block_id] = list(self.host[slot])
        self.running[seq_id] = self.swapped.pop(seq_id)
        event("swapped in")

    @rule()
    def reset_prefix_cache(self) -> None:
        referenced_hashed = any(
            self.manager.pool.block_hash(block_id) is not None
            for seq_id in self.running
            for block_id in self.manager.block_table(seq_id)
        )
        assert self.manager.reset_prefix_cache() == (not referenced_hashed)

    def _learn_hashes(self, seq: SeqModel) -> None:
        parent = None
        for index in range(seq.computed // BLOCK_SIZE):
            block = seq.tokens[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
            parent = hash_block_tokens(parent, block, (seq.salt,) if index == 0 and seq.salt else ())
            self.known_hashes[parent] = tuple(block)

    @invariant()
    def refcounts_equal_table_references(self) -> None:
        held = Counter(block_id for seq_id in self.running for block_id in self.manager.block_table(seq_id))
        pool = self.manager.pool
        assert NULL_BLOCK not in held and pool.refcount(NULL_BLOCK) == 0
        for block_id in range(1, NUM_BLOCKS):
            assert pool.refcount(block_id) == held[block_id]
        free, evictable = set(pool.free_blocks()), set(pool.evictable_blocks())
        assert not free & evictable and not (free | evictable) & set(held)
        assert free | evictable | set(held) == set(range(1, NUM_BLOCKS))
        assert self.manager.num_free_blocks == len(free) + len(evictable)
        assert self.manager.usage == len(held) / self.manager.num_total_blocks

    @invariant()
    def at_most_one_partial_block_per_sequence(self) -> None:
        for seq_id, seq in self.running.items():
            assert len(self.manager.block_table(seq_id)) == ceil_blocks(seq.computed)

    @invariant()
    def table_rows_mirror_the_block_tables(self) -> None:
        """The array the runner gathers tables from holds each running sequence's table, padded with null."""
        seq_ids = list(self.running)
        rows = self.manager.block_tables(seq_ids)
        for seq_id, row in zip(seq_ids, rows, strict=True):
            table = self.manager.block_table(seq_id)
            assert list(row[: len(table)]) == table and not row[len(table) :].any()

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self) -> None:
        for seq_id, seq in self.running.items():
            table = self.manager.block_table(seq_id)
            for position in range(seq.computed):
                assert (
                    self.device[table[position // BLOCK_SIZE]][position % BLOCK_SIZE] == seq.tokens[position]
                )

    @invariant()
    def swapped_sequences_keep_their_tokens_on_host(self) -> None:
        all_slots = [slot for slots in self.host_slots.values() for slot in slots]
        assert len(all_slots) == len(set(all_slots))
        for seq_id, seq in self.swapped.items():
            slots = self.host_slots[seq_id]
            for position in range(seq.computed):
                assert self.host[slots[position // BLOCK_SIZE]][position % BLOCK_SIZE] == seq.tokens[position]

    @invariant()
    def cached_blocks_hold_the_content_of_their_hash(self) -> None:
        pool = self.manager.pool
        for block_id in range(1, NUM_BLOCKS):
            block_hash = pool.block_hash(block_id)
            if block_hash is not None:
                assert pool.lookup(block_hash) == block_id
                assert tuple(self.device[block_id]) == self.known_hashes[block_hash]

    @invariant()
    def host_slots_are_accounted_for(self) -> None:
        held = sum(ceil_blocks(seq.computed) for seq in self.swapped.values())
        assert self.manager.num_free_host_slots + held == NUM_SWAP_BLOCKS

    def teardown(self) -> None:
        for seq_id in [*self.running, *self.swapped]:
            self.manager.free(seq_id)
        assert self.manager.num_free_blocks == self.manager.num_total_blocks
        assert self.manager.usage == 0.0
        assert self.manager.num_free_host_slots == NUM_SWAP_BLOCKS


BlockManagerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
test_block_manager_invariants = BlockManagerMachine.TestCase
