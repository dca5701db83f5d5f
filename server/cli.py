"""`jpaged serve` flags beyond the engine's, and the entry point that starts uvicorn."""

from __future__ import annotations

import argparse
import os

from jpaged_server.lora_adapters import LoRAModule, parse_lora_module
from jpaged_server.reasoning_parsers import REASONING_PARSERS
from jpaged_server.tool_parsers import TOOL_PARSERS

from jpaged.config import EngineConfig

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20  # far above the JSON of any prompt a max_model_len admits
DEFAULT_MAX_STORED_RESPONSES = 1024


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name", default=None, help="name clients use (default: the model path)"
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("JPAGED_API_KEY"), help="also read from JPAGED_API_KEY"
    )
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template, inline or a file path")
    parser.add_argument(
        "--shutdown-grace-period", type=float, default=30.0, help="seconds to finish requests on SIGTERM"
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="requests that may wait beyond --max-num-seqs before new ones get 503",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies get 413 before they are read whole",
    )
    parser.add_argument(
        "--strict-request-fields",
        action="store_true",
        help="refuse (400) request fields the server does not know, instead of ignoring them as vLLM does",
    )
    parser.add_argument(
        "--max-stored-responses",
        type=int,
        default=DEFAULT_MAX_STORED_RESPONSES,
        help="Responses API: how many responses the server keeps for previous_response_id and GET "
        "/v1/responses/{id}, the least recently used forgotten first (vLLM keeps all); 0 stores none",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    parser.add_argument(
        "--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None, help="the model's tool-call format"
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split <think> reasoning into message.reasoning",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served as models (needs --enable-lora): name=path items or JSON objects "
        '{"name": ..., "path": ..., "base_model_name": ...}',
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=runtime_lora_updating_from_env(),
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter; also set by "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (or true)",
    )


def runtime_lora_updating_from_env() -> bool:
    """vLLM's switch for the adapter loading routes: VLLM_ALLOW_RUNTIME_LORA_UPDATING set to 1 or true."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


def lora_modules(args: argparse.Namespace, config: EngineConfig) -> list[LoRAModule]:
    """The adapters to serve from the start; the flag is checked against --enable-lora here."""
    if args.lora_modules and not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (the engine holds no adapters without it)")
    return args.lora_modules


def auto_tool_parser(args: argparse.Namespace) -> str | None:
    """The tool parser for tool_choice "auto", or None when it is off; the pair of flags is checked here."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    from jpaged_server.api_server import run_server

    return run_server(args, config)
