"""A follower process of a multi-process engine: it builds the runners process 0 describes and repeats each device
action process 0 sends (runner/leader_runner.py has the messages and process 0's side)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jpaged.core.kv_cache_sizing import configure_accelerator_allocator
from jpaged.models.llama import abstract_params
from jpaged.models.loader import LoadedModel, load_model
from jpaged.models.params import check_same_leaves
from jpaged.runner.leader_runner import FollowerStart
from jpaged.runner.model_runner import ModelRunner
from jpaged.runner.multihost import connect_to_leader, receive

logger = logging.getLogger(__name__)


def follow(gpu_memory_utilization: float = 0.9) -> int:
    """A follower process's whole life: start the backend (every process starts theirs together: they exchange
    their devices), connect to process 0, then run what it sends (build a runner, run a device action on one)
    until it says stop (returns 0) or goes away (returns 1)."""
    configure_accelerator_allocator(gpu_memory_utilization)
    jax.devices()
    connection = connect_to_leader()
    logger.info("following process 0 (process %d of %d)", jax.process_index(), jax.process_count())
    runners: dict[int, ModelRunner] = {}
    loaded: LoadedModel | None = None  # the next engine's model
    while True:
        try:
            engine_id, action, args = receive(connection)
        except (EOFError, OSError):
            logger.error("process 0 went away: this follower stops")
            return 1
        if action == "stop":
            return 0
        if action == "load":
            model, dtype, lazy, keep_blocks = args
            loaded = load_model(model, jnp.dtype(dtype), progress=False, lazy=lazy, keep_blocks=keep_blocks)
        elif action == "start":
            runners[engine_id], loaded = _follower_runner(*args, loaded), None
        elif action == "close":
            del runners[engine_id]
        else:
            getattr(runners[engine_id], action)(*args)


def _follower_runner(start: FollowerStart, model: LoadedModel) -> ModelRunner:
    """The runner process 0 described, on the weights this process loaded."""
    check_same_leaves(
        abstract_params(start.model_config, jnp.dtype(start.dtype)),
        model.params,
        f"the weights this process loaded from {model.source.path}",
    )
    return ModelRunner(
        start.config,
        start.model_config,
        model.params,
        start.num_blocks,
        start.max_model_len,
        start.num_swap_blocks,
    )
