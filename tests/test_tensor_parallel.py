"""Tensor parallelism over simulated CPU devices gives the tokens and logprobs of one device, each device
holding only its shard of the weights and the KV pool (a copy of one KV head when the devices outnumber them);
sizes that cannot split the heads are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from peft_adapters import make_adapter

from jpaged.models.checkpoint import save_checkpoint
from jpaged.models.loader import load_model

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")


def generate(
    model: str, *sizes: int, features: bool = False, quantization: str = "none", lora: list[str] = ()
) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    options = ["--engine-features"] if features else ["--quantization", quantization]
    if lora:
        options = ["--lora", ",".join(lora)]
    command = [sys.executable, str(WORKER), *options, model, *map(str, sizes)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_same_tokens(one: dict, split: dict, tolerance: float) -> None:
    assert split["tokens"] == one["tokens"]
    for ours, theirs in zip(split["logprobs"], one["logprobs"], strict=True):
        for step, expected in zip(ours, theirs, strict=True):
            assert step.keys() == expected.keys()
            assert all(abs(step[t] - expected[t]) < tolerance for t in step)


def assert_same_as_one_device(runs: dict, tp: int, tolerance: float = 1e-5) -> None:
    one, split = runs["1"], runs[str(tp)]
    assert_same_tokens(one, split, tolerance)
    for name in ("qkv_bytes", "pool_bytes"):  # each of the tp devices holds 1/tp
        total, shards = split[name]
        assert shards == [total // tp] * tp and one[name][1] == [total]
    assert split["placed as laid out"]


@pytest.mark.parametrize(
    "family", ["llama", "qwen2_bias", "qwen3_qk_norm", "phi3_partial_rotary", "gemma2", "gemma3"]
)
def test_two_and_four_devices_generate_as_one_and_hold_their_share(family, tiny_model_dir):
    runs = generate(str(tiny_model_dir(family)), 1, 2, 4, 3)
    assert_same_as_one_device(runs, 2)
    # The step's collectives: all-reduces of hidden states [T, 64] (the vocabulary-split embedding, then in the
    # one compiled layer the attention output and MLP down projections), none over the pool's pages [.., 40, 16, ..].
    collectives = runs["2"]["collectives"]
    assert sum(op == "all-reduce" and shape.split("{")[0].endswith(",64]") for op, shape in collectives) >= 3
    assert not any(",40,16," in shape for _, shape in collectives)
    assert runs["1"]["collectives"] == []
    assert runs["3"] == {"error": "tensor_parallel_size (3) must divide the model's 4 attention heads"}
    # Four devices, two KV heads: each KV head is held twice, each device keeping the one its query head reads.
    assert_same_tokens(runs["1"], runs["4"], 1e-5)
    one_pool = runs["1"]["pool_bytes"][0]
    assert runs["4"]["pool_bytes"] == [2 * one_pool, [one_pool // 2] * 4]


def test_an_orbax_checkpoint_is_restored_straight_into_each_devices_shard(tiny_model_dir, tmp_path):
    """Each device reads its own part of every leaf from the checkpoint (its KV heads twice over at tp 4), and
    the engine generates as one device does."""
    source = load_model(str(tiny_model_dir("qwen2_bias")), progress=False)
    save_checkpoint(tmp_path / "ckpt", source.config, source.params, source.tokenizer)
    runs = generate(str(tmp_path / "ckpt"), 1, 2, 4)
    assert_same_as_one_device(runs, 2)
    assert_same_tokens(runs["1"], runs["4"], 1e-5)
    assert runs["4"]["placed as laid out"]
    restored = {"sharded restores": 1, "leaves read whole": 0}
    assert runs["2"]["orbax reads"] == runs["4"]["orbax reads"] == restored


def test_the_embedded_model_splits_its_nine_heads_three_ways_and_refuses_two():
    runs = generate("default", 1, 3, 2)
    # One device sums each product in the C++ matmul kernel's order, three all-reduce XLA's partial dots: the
    # logprobs (up to 7 in size, of logits up to ~20) differ by ~5e-5.
    assert_same_as_one_device(runs, 3, tolerance=1e-4)
    assert runs["2"] == {"error": "tensor_parallel_size (2) must divide the model's 9 attention heads"}


def test_the_embedded_model_split_three_ways_keeps_its_blocks_and_generates_as_one_device():
    """Its Q4_1 blocks as stored (codes two to a byte): each device holds a third of every fused matrix's codes,
    scales and biases, and the tokens and logprobs are one device's (both multiplying by XLA's dots: see
    tensor_parallel_worker.py)."""
    runs = generate("default", 1, 3, quantization="kept")
    assert_same_as_one_device(runs, 3, tolerance=1e-4)
    assert "PackedCodes" in runs["3"]["held"]


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_matrices_quantized_on_the_devices_split_two_ways_generate_as_one_device(
    quantization, tiny_model_dir
):
    """--quantization int8 or fp8 quantizes each device's part where it lies. A W8A8 product quantises its
    activations, which turns the last bit of a float difference between the split and the whole forms (the
    attention's, the fp8 sums' order) into a whole step; over a small model's two layers the logprobs stay within
    1e-3 (the thirty of the embedded model amplify it to tenths)."""
    runs = generate(str(tiny_model_dir("llama")), 1, 2, quantization=quantization)
    assert_same_as_one_device(runs, 2, tolerance=1e-3)
    assert "QuantizedMatrix" in runs["2"]["held"]


def test_prefix_caching_preemption_parallel_samples_beams_and_speculation_work_unchanged_on_two_devices(
    tiny_llama_dir,
):
    runs = generate(str(tiny_llama_dir), 1, 2, features=True)
    assert runs["2"] == runs["1"]
    one = runs["1"]
    assert one["prefix hits"] > 0 and one["prefix caching"][0] == one["prefix caching"][1]
    assert one["preemptions recompute"] > 0 and one["preemptions swap"] > 0
    assert one["preemption recompute"] == one["preemption swap"]
    assert [tokens[:8] for tokens in one["preemption swap"]] == one["prefix caching"][0]  # greedy, 8 of 40
    speculated, plain = one["speculative"]
    assert speculated == plain and one["accepted"] > 0


def test_lora_adapters_mixed_with_the_base_model_on_two_devices_generate_as_one(tiny_llama_dir, tmp_path):
    """A and B split as their base matrix is (B by columns for qkv, A by rows for o): each device holds half."""
    adapters = [
        make_adapter(tiny_llama_dir, tmp_path, "all", rank=8, seed=1),
        make_adapter(tiny_llama_dir, tmp_path, "qv", rank=4, targets=("q_proj", "v_proj"), seed=2),
    ]
    runs = generate(str(tiny_llama_dir), 1, 2, lora=[str(a.path) for a in adapters])
    assert_same_tokens(runs["1"], runs["2"], tolerance=1e-5)
    tokens = runs["2"]["tokens"]
    per_adapter = [tokens[i : i + 3] for i in range(0, len(tokens), 3)]  # the worker's three prompts each
    assert per_adapter[1] != per_adapter[0] and per_adapter[2] != per_adapter[0]
    for name in ("qkv_b_bytes", "o_a_bytes"):
        total, shards = runs["2"][name]
        assert shards == [total // 2] * 2
