"""A mixture of experts over several devices. Tensor parallelism splits each expert's MLP as it splits the dense
one (gate|up columns grouped per device); expert parallelism (--enable-expert-parallel) gives each device whole
experts, E / tp of them, and moves the step's tokens to them and back, in either form (the tokens every device
holds, or an all-to-all), never the experts' weights. Either way the greedy tokens are one device's, each device
holds 1/tp of the experts' bytes, read from the files for its own experts alone, and nothing compiles after
warm-up whatever the routing. On simulated CPU devices (tensor_parallel_worker.py), and over two processes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_multihost import START_SECONDS, free_port, last_json_line, process_env

from jpaged.config import EngineConfig
from jpaged.entrypoints.cli import add_engine_args, engine_config_from_args
from jpaged.models.families.family import experts_checkpoint
from jpaged.models.lazy_weights import FusedWeight
from jpaged.models.loader import load_model
from jpaged.models.weights import read_hf_config, safetensors_slicer
from jpaged.runner.expert_parallel import check_expert_parallel

HERE = Path(__file__).parent


def worker(*args: str, devices: int = 4) -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    command = [sys.executable, str(HERE / "tensor_parallel_worker.py"), *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_generates_as_one_device(one: dict, split: dict) -> None:
    assert split["tokens"] == one["tokens"]
    for ours, theirs in zip(split["logprobs"], one["logprobs"], strict=True):
        for step, expected in zip(ours, theirs, strict=True):
            assert step.keys() == expected.keys()
            assert all(abs(step[t] - expected[t]) < 1e-5 for t in step)


def assert_holds_its_share_of_the_experts(run: dict, tp: int, devices: int | None = None) -> None:
    """Each device (of the `devices` this process addresses) holds 1/tp of each expert stack's bytes, and the
    step moves none of them."""
    for total, shards in run["experts_bytes"]:
        assert shards == [total // tp] * (devices or tp)
    assert run["expert weights moved"] == []


@pytest.fixture(scope="module")
def expert_parallel_runs(tiny_model_dir) -> dict:
    return worker("--enable-expert-parallel", str(tiny_model_dir("qwen3_moe")), "1", "2", "4")


def test_tensor_parallelism_splits_each_experts_mlp_and_generates_as_one_device(tiny_model_dir):
    """Without the flag, each device holds every expert's share of columns (and the shared expert's)."""
    runs = worker(str(tiny_model_dir("qwen2_moe")), "1", "2")
    assert_generates_as_one_device(runs["1"], runs["2"])
    assert_holds_its_share_of_the_experts(runs["2"], 2)
    assert runs["2"]["placed as laid out"]


def test_two_and_four_devices_with_expert_parallelism_generate_as_one(expert_parallel_runs):
    """The default form at these batch sizes: every device holds the step's tokens, computes its own experts'
    pairs, and one all-reduce a layer of the hidden states [T, 64] sums them."""
    one = expert_parallel_runs["1"]
    for tp in (2, 4):
        split = expert_parallel_runs[str(tp)]
        assert_generates_as_one_device(one, split)
        assert_holds_its_share_of_the_experts(split, tp)
        assert split["placed as laid out"]
        assert {op for op, _ in split["collectives"]} == {"all-reduce"}
        assert all(shape.split("{")[0].endswith(",64]") for _, shape in split["collectives"])


def test_the_all_to_all_form_generates_as_one_device_and_compiles_nothing_after_warm_up(tiny_model_dir):
    """Every step in the all-to-all form, on Qwen2-MoE (its shared expert stays tensor-parallel): the tokens go
    to their experts' devices and back, and sampling's other routings compile nothing after warm-up."""
    runs = worker(
        "--enable-expert-parallel", "--all-to-all", "--warm", str(tiny_model_dir("qwen2_moe")), "1", "4"
    )
    split = runs["4"]
    assert_generates_as_one_device(runs["1"], split)
    assert_holds_its_share_of_the_experts(split, 4)
    assert any(op == "all-to-all" for op, _ in split["collectives"])
    assert split["compiled after warm-up"] == 0


def test_both_forms_give_one_devices_mixture_whatever_the_routing():
    """Every pair routed to one device's experts (its all-to-all buffer full from every device), all tokens to
    the same two experts, random; padding rows past the live ones."""
    for tp, by_routing in worker("--mixture-forms", "2", "4").items():
        for routing, by_form in by_routing.items():
            assert by_form["replicated"] < 1e-5 and by_form["all_to_all"] < 1e-5, (tp, routing)


def test_two_processes_hold_their_devices_experts_and_generate_as_one(tiny_model_dir, expert_parallel_runs):
    """tensor_parallel_size 4 over two processes of two devices each, with expert parallelism: process 0's two
    devices hold two experts each."""
    model, port = str(tiny_model_dir("qwen3_moe")), free_port()
    command = [sys.executable, str(HERE / "multihost_worker.py"), model, "4", "--enable-expert-parallel"]
    follower = subprocess.Popen(
        command, env=process_env(port, 1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    leader = subprocess.run(
        command, env=process_env(port, 0), capture_output=True, text=True, timeout=START_SECONDS
    )
    follower_stderr = follower.communicate(timeout=120)[1]
    assert leader.returncode == 0, leader.stderr[-3000:]
    assert follower.returncode == 0, follower_stderr[-3000:]
    two = last_json_line(leader.stdout)["run"]
    assert_generates_as_one_device(expert_parallel_runs["1"], two)
    assert_holds_its_share_of_the_experts(two, 4, devices=2)
    assert two["placed as laid out"]


def test_a_size_that_does_not_divide_the_experts_is_refused_naming_the_field(tiny_model_dir):
    config = read_hf_config(tiny_model_dir("qwen3_moe"))
    check_expert_parallel(4, config)
    with pytest.raises(
        ValueError, match=r"enable_expert_parallel: tensor_parallel_size \(3\) must divide .* 8 experts"
    ):
        check_expert_parallel(3, config)


def test_the_flag_is_spelled_as_vllm_spells_it():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--tensor-parallel-size", "2", "--enable-expert-parallel"])
    config = engine_config_from_args(args)
    assert config.enable_expert_parallel and config.tensor_parallel_size == 2
    assert not EngineConfig().enable_expert_parallel


def test_a_device_reads_only_its_own_experts_from_the_files(tiny_model_dir):
    """The lazy expert stacks [L, E, ...] cut at experts 4..7 read those experts' tensors and no others, and give
    what the whole checkpoint's stack holds there."""
    model_dir = tiny_model_dir("qwen3_moe")
    loaded = load_model(str(model_dir), progress=False)
    slicer, read = safetensors_slicer(model_dir), []

    def recording(name: str):
        read.append(name)
        return slicer(name)

    recipes = experts_checkpoint(
        loaded.config, "mlp.", "gate.weight", ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    )
    for leaf in ("experts_gate_up", "experts_down"):
        weight = FusedWeight.of(recipes[f"layers/mlp/{leaf}"], recording, 2, np.float32, 8)
        expected = loaded.params["layers"]["mlp"][leaf]
        assert weight.shape == expected.shape
        read.clear()
        part = weight[:, 4:8, :, :]
        np.testing.assert_array_equal(part, expected[:, 4:8])
        experts_read = {int(name.split(".experts.")[1].split(".")[0]) for name in read}
        assert experts_read == {4, 5, 6, 7}
