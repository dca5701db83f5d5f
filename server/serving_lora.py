"""vLLM's routes that load and unload LoRA adapters while serving, registered only when runtime updating is
allowed (--allow-runtime-lora-updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING), so a server without it answers 404.

Success is vLLM's plain-text message with 200. An unloaded adapter's requests already running finish with it;
later ones naming it are 404s.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from jpaged_server.errors import APIError
from jpaged_server.lora_adapters import LoRAModule
from jpaged_server.protocol import RequestModel
from jpaged_server.state import get_state


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str


async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state = get_state(request)
    held = await asyncio.to_thread(state.engine.list_loras)  # waits for the engine lock: up to one step
    try:
        lora = state.loras.new_request(LoRAModule(body.lora_name, body.lora_path), held)
    except ValueError as err:
        raise APIError(400, str(err), "lora_name") from None
    try:  # the engine reads and checks the adapter's files: off the event loop
        await asyncio.to_thread(state.engine.add_lora, lora)
    except ValueError as err:  # it names the adapter, its path and what is wrong
        raise APIError(400, str(err), "lora_path") from None
    state.loras.add(lora)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state = get_state(request)
    lora = state.loras.remove(body.lora_name)
    if lora is None:
        raise APIError(404, f"the LoRA adapter {body.lora_name!r} cannot be found", "lora_name")
    await asyncio.to_thread(state.engine.remove_lora, lora.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def add_lora_routes(app: FastAPI) -> None:
    app.post("/v1/load_lora_adapter")(load_lora_adapter)
    app.post("/v1/unload_lora_adapter")(unload_lora_adapter)
