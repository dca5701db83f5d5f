"""The C++ CPU experts kernel (pallas/cpu/expert_matmul.py) against a float64 numpy oracle on fresh random inputs:
rows sorted by expert in runs of any size (experts no row takes, one expert taking them all), rows past the groups
zero, widths that do not fill their panels, one layer's experts picked from a stack, and the gated form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.pallas.cpu import expert_matmul, library
from jpaged.pallas.cpu import matmul as cpu_matmul

pytestmark = pytest.mark.skipif(
    not library.available(expert_matmul.KERNEL), reason="the C++ CPU kernels do not build here"
)
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
GROUPS = {"uneven": [3, 0, 6, 1, 2], "one_takes_all": [0, 0, 12, 0, 0], "none": [0, 0, 0, 0, 0]}


def oracle(x, w, sizes, gated: bool) -> np.ndarray:
    """float64: each run of rows times its expert's matrix (silu(gate) * up of gate|up where gated); rows past the
    groups zero."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[-1] // (2 if gated else 1)))
    start = 0
    for e, size in enumerate(sizes):
        y = x[start : start + size] @ w[e]
        if gated:
            gate, up = np.split(y, 2, axis=-1)
            y = gate / (1 + np.exp(-gate)) * up
        out[start : start + size] = y
        start += size
    return out


def relative_error(got, expected) -> float:
    return float(np.abs(np.asarray(got, np.float64) - expected).max() / max(np.abs(expected).max(), 1e-30))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("groups", sorted(GROUPS))
@pytest.mark.parametrize("n", [24, 64])
def test_each_run_of_rows_takes_its_experts_matrix_from_one_layer_of_the_stack(dtype, groups, n):
    rng = np.random.default_rng(hash((dtype, groups, n)) % 2**32)
    sizes = GROUPS[groups]
    num_layers, num_experts, k, rows = 3, len(sizes), 40, 14  # 14 rows, 12 at most in the groups
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w = jnp.asarray(rng.standard_normal((num_layers, num_experts, k, 2 * n)) * 0.3, dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)

    got = expert_matmul.matmul(x, cpu_matmul.kernel_panels(w), group_sizes, 2 * n, layer=jnp.int32(1))
    expected = oracle(x, w[1], sizes, gated=False)
    assert relative_error(got, expected) < TOLERANCE[dtype] or not expected.any()
    assert not np.asarray(got)[sum(sizes) :].any()
    if n % cpu_matmul.PANEL == 0:  # the gated form's panels pair gate and up 16 columns at a time
        gated = expert_matmul.gated_matmul(
            x, cpu_matmul.kernel_panels(w, gated=True), group_sizes, n, layer=2
        )
        expected = oracle(x, w[2], sizes, gated=True)
        assert relative_error(gated, expected) < TOLERANCE[dtype] or not expected.any()
        assert not np.asarray(gated)[sum(sizes) :].any()


def test_mismatched_inputs_are_refused_with_a_value_error():
    x = jnp.zeros((4, 32), jnp.float32)
    panels = cpu_matmul.pack(jnp.zeros((1, 3, 32, 16), jnp.float32))
    with pytest.raises(ValueError, match="group_sizes"):
        expert_matmul.matmul(x, panels, jnp.zeros(2, jnp.int32), 16, layer=0)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        expert_matmul.matmul(x.astype(jnp.bfloat16), panels, jnp.zeros(3, jnp.int32), 16, layer=0)
    with pytest.raises(ValueError, match="multiple of 16"):
        expert_matmul.gated_matmul(x, panels, jnp.zeros(3, jnp.int32), 8, layer=0)
    assert jax.jit(lambda s: expert_matmul.matmul(x, panels, s, 16, layer=0))(
        jnp.ones(3, jnp.int32)
    ).shape == (4, 16)
