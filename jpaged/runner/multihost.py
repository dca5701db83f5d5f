"""One engine over several processes (a TPU pod slice, a multi-node GPU cluster): joining the process group, and
the control channel from process 0, which decides every step, to the others, which repeat its device actions.

The step itself needs nothing from here: its mesh spans every process's devices and XLA's collectives cross the
hosts. What the followers need is the step's inputs, in order. They go as pickled (action, arguments) messages over
one socket per follower (`multiprocessing.connection`, authenticated with a key process 0 publishes in JAX's
coordination store): a host-to-host send of a few KB, with no device collective or compilation per input size,
which `multihost_utils.broadcast_one_to_all` would cost (scripts/bench_multihost.py measures both). A follower's
closed socket is how process 0 learns that it died.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import pickle
import secrets
import threading
from multiprocessing.connection import Client, Connection, Listener

import jax
from jax._src import distributed  # the coordination store's client, as orbax-checkpoint reaches it

logger = logging.getLogger(__name__)

CONTROL_KEY = "jpaged/control"  # where process 0 publishes its control port and key
CONTROL_PORT_VARIABLE = "JPAGED_CONTROL_PORT"  # process 0's control port (default: any free one)
CONNECT_TIMEOUT_MS = 3_600_000  # a follower waits this long for process 0 to start its first engine


def distributed_requested() -> bool:
    """Whether the environment sets up a process group (JAX's coordinator variable)."""
    return "JAX_COORDINATOR_ADDRESS" in os.environ


def initialize_distributed() -> int:
    """Join the process group: `jax.distributed.initialize` with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID where they are set, else what JAX detects from the cluster (SLURM, Open MPI, Cloud TPU,
    Kubernetes). CPU processes run their collectives over gloo. Must come before anything starts JAX's
    backends. Returns this process's id (process_id)."""
    if jax.distributed.is_initialized():
        return process_id()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    numbers = {}
    for name, key in (("num_processes", "JAX_NUM_PROCESSES"), ("process_id", "JAX_PROCESS_ID")):
        if key in os.environ:
            try:
                numbers[name] = int(os.environ[key])
            except ValueError:
                raise ValueError(f"{key} must be an integer, got {os.environ[key]!r}") from None
    jax.distributed.initialize(**numbers)
    return process_id()


def process_id() -> int:
    """This process's index in the group (0 alone), read without starting JAX's backends (the GPU allocator
    must be configured first)."""
    return distributed.global_state.process_id


class Followers:
    """Process 0's connections to every other process, one set for the process's life. `send` gives each
    follower the same message, in order, from any thread; a follower whose socket closes (its process died) sets
    `failure`, and later sends raise. `send_later` is for garbage-collection finalizers, which may run
    in the middle of a send: their messages go ahead of the next one."""

    def __init__(self) -> None:
        key = secrets.token_bytes(32)
        listener = Listener(("", int(os.environ.get(CONTROL_PORT_VARIABLE, "0"))), authkey=key)
        port = listener.address[1]
        distributed.global_state.client.key_value_set(CONTROL_KEY, f"{port}:{key.hex()}")
        logger.info("waiting for %d follower processes on port %d", jax.process_count() - 1, port)
        self._connections = [listener.accept() for _ in range(jax.process_count() - 1)]
        listener.close()
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._later: collections.deque = collections.deque()
        self._closed = False
        for connection in self._connections:
            threading.Thread(target=self._watch, args=(connection,), daemon=True).start()

    def _watch(self, connection: Connection) -> None:
        """Followers never write: a read returns only when the socket closes."""
        with contextlib.suppress(EOFError, OSError):
            connection.recv_bytes()
        if self.failure is None and not self._closed:
            self.failure = "a follower process went away; the engine spans every process and cannot go on"
            logger.error(self.failure)

    def send(self, message) -> None:
        if self.failure is not None:
            raise RuntimeError(self.failure)
        with self._lock:
            self._later.append(message)
            try:
                while self._later:
                    data = pickle.dumps(self._later.popleft(), protocol=pickle.HIGHEST_PROTOCOL)
                    for connection in self._connections:
                        connection.send_bytes(data)
            except OSError as err:
                self.failure = f"a follower process went away ({err}); the engine spans every process"
                raise RuntimeError(self.failure) from err

    def close(self, last_message) -> None:
        """Send the followers their last message (they exit on it): their sockets closing is no failure now."""
        if self.failure is None:
            self._closed = True
            self.send(last_message)

    def send_later(self, message) -> None:
        self._later.append(message)


def connect_to_leader() -> Connection:
    """A follower's connection to process 0, once process 0 has published its port (as its first engine starts)."""
    port, key = distributed.global_state.client.blocking_key_value_get(CONTROL_KEY, CONNECT_TIMEOUT_MS).split(
        ":"
    )
    host = distributed.global_state.coordinator_address.rsplit(":", 1)[0].strip("[]")  # process 0's
    return Client((host, int(port)), authkey=bytes.fromhex(key))


def receive(connection: Connection):
    """The next message from process 0; EOFError when it has gone."""
    return pickle.loads(connection.recv_bytes())
