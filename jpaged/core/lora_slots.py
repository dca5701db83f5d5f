"""Which LoRA adapter sits in which device slot (host core, no JAX).

The device holds `max_loras` adapters at once (slots 1..max_loras; slot 0 is the base model). A sequence holds its
adapter's slot while it runs (or is swapped out, its KV computed under it); a slot no sequence holds stays filled,
so the next request for that adapter finds it, until another adapter needs the slot: the least recently used idle
one gives it up. A request whose adapter finds no slot free waits; a slot in use is never taken.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: dict[int, int] = {}  # resident adapter id -> its slot
        self._users: Counter[int] = Counter()  # adapter id -> sequences holding it
        self._idle: OrderedDict[int, None] = (
            OrderedDict()
        )  # resident, unheld adapters, least recently used first
        self._pending: list[tuple[int, int]] = []  # (slot, adapter id) to write before the next step
        self.num_loads = 0  # adapters written into a slot (first loads and LRU swaps)
        self.num_evictions = 0  # idle adapters that gave their slot up

    def slot_of(self, lora_id: int) -> int:
        """The slot a held adapter sits in (0: no adapter)."""
        return self._slot_of[lora_id] if lora_id else 0

    @property
    def num_in_use(self) -> int:
        """Slots that running (or swapped-out) sequences hold."""
        return len(self._users)  # an adapter no sequence holds leaves _users

    @property
    def num_resident(self) -> int:
        return len(self._slot_of)

    def acquire(self, lora_id: int) -> bool:
        """Hold adapter `lora_id` for one more sequence, giving it a slot if it has none (an empty one, else the
        least recently used idle one's: a write queued for `take_pending_loads`); False when every slot is in use."""
        if lora_id not in self._slot_of:
            slot = self._free_slot()
            if slot is None:
                return False
            self._slot_of[lora_id] = slot
            self._pending.append((slot, lora_id))
            self.num_loads += 1
        self._idle.pop(lora_id, None)
        self._users[lora_id] += 1
        return True

    def release(self, lora_id: int) -> None:
        """One sequence lets go of `lora_id`; with none left holding it, it stays resident, idle."""
        self._users[lora_id] -= 1
        if self._users[lora_id] == 0:
            del self._users[lora_id]
            self._idle[lora_id] = None

    def evict(self, lora_id: int) -> None:
        """Forget an idle adapter's slot (an adapter removed, or changed: it is written again when next acquired);
        a held one keeps its slot until released (then, idle, it gives it up when another adapter needs one)."""
        if lora_id in self._idle:
            del self._idle[lora_id]
            del self._slot_of[lora_id]
            self._pending = [(slot, i) for slot, i in self._pending if i != lora_id]

    def reload(self, lora_id: int) -> None:
        """Queue adapter `lora_id`'s slot to be written again (its weights changed), if it has one."""
        if lora_id in self._slot_of and (self._slot_of[lora_id], lora_id) not in self._pending:
            self._pending.append((self._slot_of[lora_id], lora_id))

    def take_pending_loads(self) -> list[tuple[int, int]]:
        """(slot, adapter id) writes due before the next step, each once."""
        pending, self._pending = self._pending, []
        return pending

    def _free_slot(self) -> int | None:
        taken = set(self._slot_of.values())
        empty = next((slot for slot in range(1, self.max_loras + 1) if slot not in taken), None)
        if empty is not None or not self._idle:
            return empty
        victim, _ = self._idle.popitem(last=False)
        self.num_evictions += 1
        return self._slot_of.pop(victim)
