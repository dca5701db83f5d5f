"""The engine's LoRA adapters: which are registered (by id and name), a host cache of the ones read (LRU,
max_cpu_loras), and the writes into device slots the scheduler's slot choices call for (core/lora_slots.py).

A request's prefix-cache key names its adapter and that adapter's version (bumped when its weights change), so a
block computed under one adapter is never a hit for another, for the base model, or for the adapter's old weights.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jpaged.config import EngineConfig
from jpaged.core.lora_slots import LoRASlots
from jpaged.lora_request import LoRARequest
from jpaged.models.config import ModelConfig
from jpaged.models.lora_weights import (
    LoRAAdapter,
    adapter_from_layout,
    adapter_from_tensors,
    is_layout,
    read_adapter,
)


@dataclass(frozen=True)
class LoRAStats:
    max_loras: int
    slots_in_use: int  # slots running (or swapped-out) sequences hold
    slots_filled: int  # slots holding an adapter, in use or idle
    slot_loads: int  # adapters written into a slot: first loads and LRU swaps
    evictions: int  # idle adapters that gave their slot to another
    requests: dict[str, int] = field(default_factory=dict)  # requests added, by adapter name


class LoRAAdapters:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, slots: LoRASlots | None) -> None:
        self.config = config
        self.model_config = model_config
        self.slots = slots
        self._registered: dict[int, LoRARequest] = {}
        self._ids: dict[str, int] = {}
        self._known: dict[int, LoRARequest] = {}  # every adapter a request named: read again when evicted
        self._cache: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._updated: dict[int, LoRAAdapter] = {}  # set by update(): kept, never read again from its files
        self._versions: Counter[int] = Counter()
        self._requests: Counter[str] = Counter()

    def add(self, lora: LoRARequest, weights: Mapping[str, Any] | None = None) -> bool:
        """Register an adapter, reading its PEFT directory now (a ValueError for one the model cannot take), or
        taking its `weights` in the engine's own layout (models/lora_weights.adapter_from_layout; kept in host
        memory); False when this very adapter is registered already."""
        if self.slots is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: the engine was started without enable_lora")
        known = self._registered.get(lora.lora_int_id)
        if known == lora:
            return False
        if known is not None:
            raise ValueError(f"lora_int_id {lora.lora_int_id} is adapter {known.lora_name!r} already")
        if lora.lora_name in self._ids:
            raise ValueError(
                f"lora_name {lora.lora_name!r} is adapter id {self._ids[lora.lora_name]} already"
            )
        if weights is None:
            adapter = self._read(lora)
        else:
            adapter = adapter_from_layout(weights, self.model_config, self.config.max_lora_rank)
            self._updated[lora.lora_int_id] = adapter
        self._registered[lora.lora_int_id] = self._known[lora.lora_int_id] = lora
        self._ids[lora.lora_name] = lora.lora_int_id
        self._cache_put(lora.lora_int_id, adapter)
        self._versions[lora.lora_int_id] += 1
        self.slots.reload(lora.lora_int_id)  # an id used before may still sit in a slot
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Unregister an adapter (requests already using it finish with it); False when it is not registered."""
        lora = self._registered.pop(lora_int_id, None)
        if lora is None:
            return False
        del self._ids[lora.lora_name]
        self._cache.pop(lora_int_id, None)
        self._updated.pop(lora_int_id, None)
        self.slots.evict(lora_int_id)
        return True

    def list(self) -> list[LoRARequest]:
        return list(self._registered.values())

    def for_request(self, lora: LoRARequest) -> tuple[int, str]:
        """A new request's adapter id and the prefix-cache key part that names it (registering it on first use)."""
        self.add(lora)
        self._requests[lora.lora_name] += 1
        return lora.lora_int_id, f"\0lora:{lora.lora_int_id}:{self._versions[lora.lora_int_id]}"

    def update(self, name: str, tensors: Mapping[str, Any]) -> None:
        """Adapter `name`'s matrices replaced by PEFT-named `tensors` of the same shapes (its config kept), or by
        weights in the engine's own layout; written into its slot before the next step; its prefix-cache blocks
        stop matching."""
        if name not in self._ids:
            raise ValueError(f"no LoRA adapter named {name!r} (registered: {sorted(self._ids)})")
        lora_id = self._ids[name]
        max_rank = self.config.max_lora_rank
        if is_layout(tensors):
            adapter = adapter_from_layout(tensors, self.model_config, max_rank)
        else:
            adapter = adapter_from_tensors(
                tensors, self._adapter(lora_id).config, self.model_config, max_rank
            )
        self._updated[lora_id] = adapter
        self._versions[lora_id] += 1
        self.slots.reload(lora_id)

    def load_pending(self, write: Callable[[int, dict], None]) -> None:
        """Write the adapters the scheduler just gave slots to into those slots (`write(slot, weights)`: the
        runner's, before the step that reads them)."""
        for slot, lora_id in self.slots.take_pending_loads():
            write(slot, self._adapter(lora_id).weights)

    def slot_of(self, lora_id: int) -> int:
        return self.slots.slot_of(lora_id)

    def stats(self) -> LoRAStats:
        slots = self.slots
        if slots is None:
            return LoRAStats(0, 0, 0, 0, 0)
        return LoRAStats(
            slots.max_loras,
            slots.num_in_use,
            slots.num_resident,
            slots.num_loads,
            slots.num_evictions,
            dict(self._requests),
        )

    def _adapter(self, lora_id: int) -> LoRAAdapter:
        if lora_id in self._updated:
            return self._updated[lora_id]
        adapter = self._cache.get(lora_id)
        if adapter is None:
            adapter = self._read(self._known[lora_id])
        self._cache_put(lora_id, adapter)
        return adapter

    def _read(self, lora: LoRARequest) -> LoRAAdapter:
        try:
            return read_adapter(lora.lora_path, self.model_config, self.config.max_lora_rank)
        except (OSError, ValueError) as err:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} at {lora.lora_path!r}: {err}") from err

    def _cache_put(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self._cache[lora_id] = adapter
        self._cache.move_to_end(lora_id)
        while len(self._cache) > self.config.lora_cache_size:
            self._cache.popitem(last=False)
