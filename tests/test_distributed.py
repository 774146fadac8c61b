"""Several processes of one run (JAX's distributed runtime, gloo collectives), on this machine: data-parallel
training equals one process on the same global batch, survives kill -9 of a process (the other stops with a
message, the run resumed as expert parallel ends on the same adapter, each checkpoint written once); sharded
generation writes one
process's records; expert parallel (each process half of every layer's experts, from a checkpoint converted with
--expert-shards) gives one process's logits and LoRA gradients."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import moe_jax
from moe_jax import distributed
from moe_jax.convert import convert
from moe_jax.distributed import ExpertShard, this_process_shard
from moe_jax.errors import CheckpointError, ConfigError, InputError
from moe_jax.formats.checkpoint import open_checkpoint
from tests.test_train import MODEL, ROOT, adapter_tensors

TRAIN_FLAGS = [
    "--no-progress",
    "--max-steps",
    "4",
    "--batch-size",
    "4",
    "--max-seq-len",
    "16",
    "--eval-interval",
    "2",
    "--eval-exact-match",
    "6",
    "--checkpoint-interval",
    "2",
    "--host-threads",
    "1",
]


def launch(processes: int, *command, **kwargs) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "moe_jax.launch", "-n", str(processes), *map(str, command)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def finished(proc: subprocess.Popen, timeout_s: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out
    return out


def process_of(launcher_pid: int, index: int) -> int:
    """The pid of the launcher's child with MOE_JAX_PROCESS_ID=index."""
    children = open(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read().split()
    for pid in map(int, children):
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        if f"{distributed.PROCESS_ID}={index}".encode() in env:
            return pid
    raise AssertionError(f"no process {index} among {children}")


def metrics_steps(run) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_data_parallel_training_equals_one_process_and_resumes_after_a_kill(tmp_path):
    """Data parallel until process 1 is killed, resumed as expert parallel: one process's run all along."""
    one, two = tmp_path / "one", tmp_path / "two"
    straight = subprocess.run(
        [sys.executable, "train.py", *TRAIN_FLAGS, "--out", str(one)], cwd=ROOT, capture_output=True, text=True
    )
    assert straight.returncode == 0, straight.stderr

    run = launch(2, "train.py", *TRAIN_FLAGS, "--out", two)
    deadline = time.monotonic() + 300
    while not (two / "checkpoints" / "2").exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(process_of(run.pid, 1), signal.SIGKILL)
    killed_at = time.monotonic()
    out, _ = run.communicate(timeout=120)
    assert run.returncode != 0, out
    assert time.monotonic() - killed_at < 60, out  # the survivor stopped by itself, well before the launcher's grace
    assert "[0] error: process 0 of 2: a collective with the other processes failed" in out, out
    assert not (two / "adapter").exists(), "the run finished before process 1 was killed"

    # resumed expert parallel (each process half of the experts): the same math, so the same run goes on (its
    # exact-match evaluation generating over the expert shards)
    expert_parallel = ["--expert-shards", "2"]
    resumed = finished(launch(2, "train.py", *TRAIN_FLAGS, *expert_parallel, "--out", two, "--resume"))
    assert "[1] wrote" not in resumed  # process 0 writes the outputs
    ours, theirs = adapter_tensors(two), adapter_tensors(one)
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_allclose(ours[key], theirs[key], atol=1e-5, err_msg=key)
    assert sorted(os.listdir(two / "checkpoints")) == ["2", "4"]  # each written once, by process 0
    assert metrics_steps(two) == metrics_steps(one) == list(range(5))
    records = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert all(len(r["host_busy_s_per_process"]) == 2 for r in records[1:])
    singles = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    for mine, single in zip(records, singles, strict=True):
        for key in ("loss", "eval_loss", "exact_match", "target_tokens"):
            if key in single:
                assert mine[key] == pytest.approx(single[key], rel=1e-5), key


def test_sharded_generation_writes_the_single_process_records_in_order(tmp_path):
    flags = ["--temperature", "0.8", "--max-new-tokens", "8"]  # sampled: each prompt keeps its own seed
    single = subprocess.run(
        [sys.executable, "infer.py", *flags, "--out", str(tmp_path / "one.jsonl")], cwd=ROOT, capture_output=True
    )
    assert single.returncode == 0, single.stderr
    finished(launch(2, "infer.py", *flags, "--out", tmp_path / "two.jsonl"))

    def records(name):
        return [
            {k: v for k, v in json.loads(line).items() if k != "seconds"}
            for line in (tmp_path / name).read_text().splitlines()
        ]

    assert records("two.jsonl") == records("one.jsonl")
    assert [r["line"] for r in records("two.jsonl")] == list(range(1, 9))
    assert not list(tmp_path.glob("*.partial*"))


def test_world_splits_batches_and_items():
    world = distributed.World(1, 2)
    assert world.rows(8) == slice(4, 8) and world.share(list(range(5))) == [1, 3]
    with pytest.raises(ConfigError, match="batch_size 5 does not split over 2 processes"):
        world.rows(5)


@pytest.mark.parametrize(
    "env, message",
    [
        ({distributed.COORDINATOR: "127.0.0.1:1"}, "needs MOE_JAX_NUM_PROCESSES, MOE_JAX_PROCESS_ID too"),
        (
            {distributed.COORDINATOR: "h:1", distributed.NUM_PROCESSES: "two", distributed.PROCESS_ID: "0"},
            "must be integers",
        ),
        ({distributed.COORDINATOR: "h:1", distributed.NUM_PROCESSES: "2", distributed.PROCESS_ID: "2"}, r"not in \[0"),
    ],
)
def test_bad_launch_variables_are_refused_by_name(monkeypatch, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        distributed.join()


def test_one_process_is_the_plain_path(monkeypatch):
    monkeypatch.setenv(distributed.COORDINATOR, "127.0.0.1:1")
    monkeypatch.setenv(distributed.NUM_PROCESSES, "1")
    monkeypatch.setenv(distributed.PROCESS_ID, "0")
    assert distributed.join() == distributed.World()
    tree = {"a": np.arange(3.0, dtype=np.float32)}
    assert distributed.weighted_mean(tree, 5)["a"].tolist() == [0.0, 1.0, 2.0]
    assert distributed.gather_objects([{"x": 1}]) == [[{"x": 1}]]


def test_expert_parallel_logits_and_gradients_equal_one_process(tmp_path):
    """Each of 2 processes holds half of every layer's experts (its own store of a checkpoint converted with
    --expert-shards 2) and its half of the batch's rows."""
    runner = ROOT / "tests" / "expert_parallel_run.py"
    alone = subprocess.run([sys.executable, str(runner), str(tmp_path / "one.npz")], capture_output=True, text=True)
    assert alone.returncode == 0, alone.stderr
    sharded = convert(MODEL, tmp_path / "sharded", progress=False, expert_shards=2)
    finished(launch(2, runner, tmp_path / "two.npz", sharded))
    one, two = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert two["store_bytes"].tolist() == [one["store_bytes"][0] / 2] * 2
    np.testing.assert_allclose(two["logits"], one["logits"], atol=1e-5)
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-6)
    grads = [k for k in one.files if k.startswith("grad/")]
    assert grads and all(np.abs(one[k]).max() > 0 for k in grads)
    for key in grads:
        np.testing.assert_allclose(two[key], one[key], atol=1e-5, err_msg=key)


def test_converted_shards_hold_their_experts_and_open_only_as_shards(tmp_path):
    """A shard's store, a Hugging Face checkpoint's experts read by range and a whole store's shard views are the
    same weights (the three ways a process of an expert-parallel run gets its experts)."""
    sharded = convert(MODEL, tmp_path / "sharded", progress=False, expert_shards=2)
    whole = open_checkpoint(convert(MODEL, tmp_path / "whole", progress=False))
    hf = open_checkpoint(MODEL)
    for index in range(2):
        shard = ExpertShard(index, 2)
        checkpoint = open_checkpoint(sharded, verify=True, expert_shard=shard)
        experts = shard.experts(4)
        assert checkpoint.store_experts == experts
        views = whole.expert_store.shard(experts)
        assert views.nbytes == whole.expert_store.nbytes // 2
        for layer in whole.config.moe_layers:
            all_of_them = whole.layer_experts(layer, np.float32)
            for mine in (
                checkpoint.layer_experts(layer, np.float32, experts),
                hf.layer_experts(layer, np.float32, experts),
                views[layer],
            ):
                np.testing.assert_array_equal(mine.w13, all_of_them.w13[experts.start : experts.stop])
                np.testing.assert_array_equal(mine.w2, all_of_them.w2[experts.start : experts.stop])
    with pytest.raises(CheckpointError, match="stored in shards of 2 .*each process of an expert-parallel run"):
        open_checkpoint(sharded)
    with pytest.raises(CheckpointError, match="stored in shards of 2, not 4"):
        open_checkpoint(sharded, expert_shard=ExpertShard(0, 4))
    with pytest.raises(InputError, match="do not split into 3 equal shards"):
        convert(MODEL, tmp_path / "three", progress=False, expert_shards=3)


def test_expert_parallel_refusals():
    with pytest.raises(ConfigError, match="do not split into 3 equal shards"):
        ExpertShard(0, 3).experts(4)
    with pytest.raises(ConfigError, match="expert_shards 2 must equal the run's process count"):
        this_process_shard(2)
    with pytest.raises(InputError, match="would leave experts uncomputed"):
        moe_jax.load_model(MODEL, expert_shard=ExpertShard(0, 2))
