"""The model runner of a multi-process engine: process 0's runner tells every follower each device action before it
runs it, and each follower's loop (`follow`) runs the same action on the same inputs, so every process launches
the same programs in the same order, as multi-controller JAX requires (see multihost.py).

The followers' side is engine/follower.py. Messages are (engine id, action, arguments): process 0 may hold
several engines in turn (or at once), and each follower holds a runner for each. "load" loads the next engine's model (every process together: orbax's restore
waits for all of them), "start" builds its runner, "close" (when process 0's engine is garbage-collected) drops
it, and "stop" (at process 0's exit) ends the follower.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jpaged.config import EngineConfig
from jpaged.models.config import ModelConfig
from jpaged.models.llama import params_dtype
from jpaged.models.loader import LoadedModel, load_model
from jpaged.runner.model_runner import ModelRunner
from jpaged.runner.multihost import Followers

logger = logging.getLogger(__name__)

_engine_ids = itertools.count()


@dataclass(frozen=True)
class FollowerStart:
    """What a follower needs to build the same runner as process 0: the settled config and sizes; it loads the
    weights (its own shards) from config.model itself."""

    config: EngineConfig
    model_config: ModelConfig
    dtype: str
    num_blocks: int
    max_model_len: int
    num_swap_blocks: int


class LeaderRunner:
    """Process 0's ModelRunner: each action that launches device work goes to the followers first. Everything
    else (reads of sizes, shapes, compiled programs; swap, which start_runner refuses here, so it never moves a
    block) is the local runner's."""

    def __init__(self, runner: ModelRunner, followers: Followers, engine_id: int) -> None:
        self._runner = runner
        self._followers = followers
        self._id = engine_id
        weakref.finalize(self, followers.send_later, (engine_id, "close", ()))

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    @property
    def failure(self) -> str | None:
        return self._followers.failure

    def _both(self, action: str, *args):
        self._followers.send((self._id, action, args))
        return getattr(self._runner, action)(*args)

    def forward(self, step):
        return self._both("forward", step)

    def sample(self, sampling):
        return self._both("sample", sampling)

    def copy_blocks(self, copies):
        return self._both("copy_blocks", copies)

    def write_lora(self, slot: int, weights: dict) -> None:
        self._both("write_lora", slot, weights)

    def warmup(self, progress: bool = True, progressive: bool = False) -> float:
        """Whole, in every process (`progressive` is not staged here: each process would take the stages at steps
        of its own, and they must run the same programs)."""
        self._followers.send((self._id, "warmup", (False,)))
        return self._runner.warmup(progress)

    def run_unrun_shape(self) -> bool:
        return self._both("run_unrun_shape")

    def sleep(self, level: int) -> None:
        self._both("sleep", level)

    def wake_up(self) -> None:
        self._both("wake_up")

    def update_weights(self, params: dict) -> None:
        raise ValueError(
            "update_weights is not available when the engine spans several processes: each process holds only "
            "its shards, and the followers have no trainer to take new weights from"
        )


def load_model_everywhere(model: str | None, dtype, *, lazy: bool, keep_blocks: bool = False) -> LoadedModel:
    """`load_model`, with every follower loading the same model (from the same path on its host) meanwhile."""
    if jax.process_count() > 1 and jax.process_index() == 0:
        _channel().send((None, "load", (model, str(jnp.dtype(dtype)), lazy, keep_blocks)))
    return load_model(model, dtype, lazy=lazy, keep_blocks=keep_blocks)


def start_runner(
    config: EngineConfig,
    model_config: ModelConfig,
    params: dict,
    *,
    from_memory: bool,
    num_blocks: int,
    max_model_len: int,
    num_swap_blocks: int,
    runner_class: Callable[..., ModelRunner] = ModelRunner,
) -> ModelRunner | LeaderRunner:
    """The engine's runner: this process's alone, or with more processes, process 0's, once every follower has
    been told what to build (they load their weights while this one places its own). A runner of another kind
    (`runner_class`: the pooling runner) runs in one process: the followers build ModelRunners."""
    runner_args = (num_blocks, max_model_len, num_swap_blocks)
    if jax.process_count() == 1:
        return runner_class(config, model_config, params, *runner_args)
    if runner_class is not ModelRunner:
        raise ValueError(f"a pooling engine runs in one process, not {jax.process_count()}")
    if jax.process_index() != 0:
        raise ValueError(
            f"this is process {jax.process_index()} of {jax.process_count()}: only process 0 runs the engine; "
            "the others run jpaged.follow() (`jpaged serve --distributed` does this on every process)"
        )
    if from_memory:
        raise ValueError(
            "an engine over weights in memory (LLM.from_params) runs in one process: the followers of a "
            "multi-process engine load the model from its path"
        )
    if config.preemption_mode == "swap":
        raise ValueError(
            "preemption_mode 'swap' keeps swapped blocks in one process's memory; an engine spanning "
            f"{jax.process_count()} processes needs 'recompute'"
        )
    channel, engine_id = _channel(), next(_engine_ids)
    start = FollowerStart(config, model_config, str(params_dtype(params)), *runner_args)
    channel.send((engine_id, "start", (start,)))
    return LeaderRunner(ModelRunner(config, model_config, params, *runner_args), channel, engine_id)


@functools.cache
def _channel() -> Followers:
    """The followers' connections, made when process 0's first engine starts (every follower connects then), and
    their "stop" at exit, registered after JAX's own exit handler so that it runs first (JAX's waits for every
    process to exit)."""
    channel = Followers()
    atexit.register(channel.close, (None, "stop", ()))
    return channel
