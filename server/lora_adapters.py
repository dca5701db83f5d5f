"""The LoRA adapters a request's `model` may name, as vLLM serves them: `--lora-modules` at start-up, and
/v1/load_lora_adapter at run time when allowed (serving_lora.py)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from jpaged import LoRARequest


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` item: the name clients use as `model`, the PEFT adapter directory, and the model
    /v1/models names as its parent (default: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """vLLM's two spellings: `name=path`, or a JSON object {"name", "path", "base_model_name"}."""
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
            module = LoRAModule(**fields)
        except (json.JSONDecodeError, TypeError) as err:
            raise argparse.ArgumentTypeError(f"invalid --lora-modules JSON {text!r}: {err}") from None
        if not isinstance(module.name, str) or not isinstance(module.path, str):
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: name and path must be strings")
    else:
        name, _, path = text.partition("=")
        module = LoRAModule(name, path)
    if not module.name or not module.path:
        raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: expected name=path or a JSON object")
    return module


@dataclass
class LoRAAdapters:
    """The adapters being served, by name, in the order they were added."""

    base_model_name: str
    _by_name: dict[str, LoRARequest] = field(default_factory=dict)
    _next_id: int = 1

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def __iter__(self) -> Iterator[LoRARequest]:
        return iter(self._by_name.values())

    def new_request(self, module: LoRAModule, held: Iterable[LoRARequest]) -> LoRARequest:
        """The LoRARequest for a module not yet served; ValueError if its name is taken. Its id is above every id
        served so far and every one the engine holds (`held`: an engine handed to the app may hold adapters the
        server did not add), so it never names another adapter."""
        if module.name == self.base_model_name:
            raise ValueError(f"the LoRA adapter name {module.name!r} is the base model's")
        if module.name in self._by_name:
            raise ValueError(f"the LoRA adapter {module.name!r} has already been loaded")
        self._next_id = max([self._next_id, *(lora.lora_int_id + 1 for lora in held)])
        lora = LoRARequest(module.name, self._next_id, module.path, module.base_model_name)
        self._next_id += 1
        return lora

    def add(self, lora: LoRARequest) -> None:
        """Serve `lora` under its name (once the engine holds it)."""
        self._by_name[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest | None:
        """Stop serving `name`: later requests naming it are 404s. None if it was not served."""
        return self._by_name.pop(name, None)
