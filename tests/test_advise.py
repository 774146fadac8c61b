"""The advisor: its co-compute/offload verdict flips where the (simulated) bus makes offload as fast as the host,
and `python -m moe_jax.advise` answers the three questions for a checkpoint."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_jax.formats.checkpoint import open_checkpoint
from moe_jax.planning.advise import Shape, advise
from moe_jax.planning.cost_model import Profile

ROWS = np.array([1.0, 64.0, 1024.0, 4096.0])
SHAPE = Shape(layers=4, experts=8, top_k=2, expert_params=3 * 512 * 1408, itemsize=2)
HOST_S, DEVICE_S = 1e-3, 2e-5  # one expert with 1024 rows (4096 tokens, top-2 of 8)


def machine(bus_gbps):
    """Host and device times proportional to rows, no fixed costs, one host worker: offload's step is
    8 copies + one expert's compute (copies bound it), co-compute's is 8 host experts."""
    return Profile(
        SHAPE.expert_bytes, bus_gbps, bus_gbps, ROWS, ROWS * HOST_S / 1024, ROWS, ROWS * DEVICE_S / 1024, host_workers=1
    )


def test_verdict_flips_at_the_crossover_bandwidth():
    # 8 c + d = 8 h  =>  c = h - d / 8  =>  bus = bytes / c
    crossover = SHAPE.expert_bytes / (HOST_S - DEVICE_S / 8) / 1e9
    below = advise(machine(0.97 * crossover), SHAPE, [4096])["rows"][0]
    above = advise(machine(1.03 * crossover), SHAPE, [4096])["rows"][0]
    assert below["co_compute_or_offload"] == "host" and above["co_compute_or_offload"] == "offload"
    assert below["options"]["host"]["step_s"] == pytest.approx(4 * 8 * HOST_S)


def test_recommendation_moves_from_host_through_auto_to_offload_as_the_bus_speeds_up():
    crossover = SHAPE.expert_bytes / (HOST_S - DEVICE_S / 8) / 1e9
    memory = 2 * SHAPE.expert_bytes * SHAPE.top_k + 1  # room for the stream buffers, not for all experts
    picks = []
    for factor in (0.05, 0.2, 1.0, 5.0, 50.0):
        row = advise(machine(factor * crossover), SHAPE, [4096], device_memory=memory)["rows"][0]
        assert not row["options"]["device"]["fits"]
        picks.append(row["recommend"])
    assert picks[0] == "host" and picks[-1] == "offload"
    assert picks[2] == "auto"  # at the crossover the lanes balance: half streamed, half on the host
    for row_pick, factor in zip(picks, (0.05, 0.2, 1.0, 5.0, 50.0), strict=True):
        row = advise(machine(factor * crossover), SHAPE, [4096], device_memory=memory)["rows"][0]
        fastest = min(row["options"]["host"]["step_s"], row["options"]["offload"]["step_s"])
        assert row["options"][row_pick]["step_s"] <= fastest  # never worse than the best single paradigm


def test_decode_stays_on_the_host_when_the_bus_is_slow():
    row = advise(machine(4.0), SHAPE, [1])["rows"][0]
    assert row["transfer"]["copy_s"] > row["transfer"]["host_s"]  # the host computes it faster than it moves
    assert row["co_compute_or_offload"] == "host"


def test_advise_cli_answers_for_a_checkpoint(tmp_path):
    out = tmp_path / "advice.json"
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_jax.advise",
            "--model",
            str(root / "models" / "tiny-moe"),
            "--profile",
            str(root / "tests" / "data" / "probe_2core_cpu.json"),
            "--batch",
            "1",
            "512",
            "--bus-gbps",
            "16",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    headings = ("1. is one expert's compute", "2. can this CPU do the experts", "3. predicted whole-step", "4. does it")
    for heading in (*headings, "5. does the device/host micro-batch pipeline pay"):
        assert heading in result.stdout
    answer = json.loads(out.read_text())
    assert [r["tokens"] for r in answer["rows"]] == [1, 512]
    # --bus-gbps simulates a separate device: its lanes run at once, so the pipeline may pay at 512 tokens
    assert [r["pipeline"]["rows"] for r in answer["rows"]] == [1, 1]
    assert answer["rows"][0]["pipeline"]["micro_batches"] == 1  # one row: nothing to split
    assert all(r["recommend"] in ("device", "offload", "host", "auto") for r in answer["rows"])
    bad = subprocess.run(
        [sys.executable, "-m", "moe_jax.advise", "--model", str(root / "models" / "tiny-moe"), "--batch", "0"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--batch" in bad.stderr


def test_host_memory_answer_says_what_would_fit():
    from moe_jax.formats.checkpoint import open_checkpoint
    from moe_jax.planning.advise import host_memory_question

    checkpoint = open_checkpoint(Path(__file__).resolve().parents[1] / "models" / "tiny-moe")
    sizes = {(o["dtype"], o["quant"]): o["bytes"] for o in host_memory_question(checkpoint, "float32", None)["options"]}
    assert sizes[("float32", None)] > sizes[("float32", "int8")] > sizes[("float32", "int4")]
    assert sizes[("float32", None)] > sizes[("bfloat16", None)]
    roomy = host_memory_question(checkpoint, "float32", sizes[("float32", None)])
    assert roomy["fits_as_asked"]
    tight = host_memory_question(checkpoint, "float32", sizes[("float32", "int4")])
    assert not tight["fits_as_asked"]
    assert (tight["first_fitting"]["dtype"], tight["first_fitting"]["quant"]) == ("float32", "int4")
    assert host_memory_question(checkpoint, "float32", 1)["first_fitting"] is None


def test_hosts_answer_counts_the_shards_whose_share_fits_a_host():
    """Each process of an expert-parallel run holds the dense weights and 1/N of the experts: the fewest N (a
    divisor of the experts per layer) whose share fits 90% of a host's RAM."""
    from moe_jax.planning.advise import HOST_RAM_USABLE, hosts_question

    checkpoint = open_checkpoint(Path(__file__).resolve().parents[1] / "models" / "tiny-moe")
    whole = hosts_question(checkpoint, "float32", 2**40)
    assert [r["hosts"] for r in whole] == [1, 1, 1]
    float_row = whole[0]
    experts = float_row["bytes_per_host"] - float_row["dense_bytes"]
    ram = int((float_row["dense_bytes"] + experts / 2) / HOST_RAM_USABLE) + 1  # half of the experts and no less
    rows = hosts_question(checkpoint, "float32", ram)
    assert rows[0]["hosts"] == 2 and rows[0]["bytes_per_host"] <= HOST_RAM_USABLE * ram
    assert rows[2]["hosts"] == 1  # int4 experts: one host holds them all
    assert hosts_question(checkpoint, "float32", float_row["dense_bytes"] // 2)[0]["hosts"] is None
