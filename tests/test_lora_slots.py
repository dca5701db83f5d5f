"""The device slots of LoRA adapters (core/lora_slots.py): filled LRU, never taken from a sequence using them."""

from __future__ import annotations

from jpaged.core.lora_slots import LoRASlots


def test_adapters_fill_empty_slots_first_each_written_once():
    slots = LoRASlots(2)
    assert slots.acquire(7) and slots.acquire(9) and slots.acquire(7)
    assert slots.take_pending_loads() == [(1, 7), (2, 9)]
    assert slots.take_pending_loads() == []
    assert (slots.slot_of(7), slots.slot_of(9), slots.slot_of(0)) == (1, 2, 0)
    assert slots.num_in_use == 2 and slots.num_loads == 2


def test_a_slot_in_use_is_never_taken_and_the_least_recently_used_idle_one_goes_first():
    slots = LoRASlots(2)
    slots.acquire(1)
    slots.acquire(2)
    assert not slots.acquire(3)  # both in use
    slots.release(2)
    slots.release(1)  # 2 went idle first
    assert slots.acquire(3)
    assert slots.slot_of(3) == 2 and slots.slot_of(1) == 1
    assert slots.num_evictions == 1
    slots.take_pending_loads()
    assert slots.acquire(1)  # still resident: no write
    assert slots.take_pending_loads() == []


def test_an_idle_adapter_stays_resident_until_its_slot_is_needed():
    slots = LoRASlots(1)
    slots.acquire(5)
    slots.release(5)
    assert slots.num_in_use == 0 and slots.num_resident == 1
    slots.take_pending_loads()
    assert slots.acquire(5) and slots.take_pending_loads() == []


def test_a_changed_adapter_is_written_again_and_a_removed_one_gives_its_slot_up_once_idle():
    slots = LoRASlots(2)
    slots.acquire(1)
    slots.take_pending_loads()
    slots.reload(1)
    slots.reload(1)
    assert slots.take_pending_loads() == [(1, 1)]
    slots.evict(1)  # held: keeps its slot
    assert slots.slot_of(1) == 1
    slots.release(1)
    slots.evict(1)
    assert slots.num_resident == 0
    assert slots.acquire(2) and slots.take_pending_loads() == [(1, 2)]
