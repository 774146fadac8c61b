"""python -m moe_jax.probe writes a profile with every figure measured (small shape, quick mode)."""

import json
import subprocess
import sys

from moe_jax.planning.cost_model import Profile
from moe_jax.planning.probe import QUICK_ROWS


def test_probe_writes_a_complete_profile(tmp_path):
    out = tmp_path / "probe.json"
    result = subprocess.run(
        [sys.executable, "-m", "moe_jax.probe", "--quick", "--shape", "64", "128", "--repeats", "1", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    profile = json.loads(out.read_text())
    assert profile["expert"] == {"hidden": 64, "ffn": 128, "bytes": 3 * 64 * 128 * 4, "dtype": "float32"}
    assert profile["bus"]["gbps"] > 0
    assert [h["rows"] for h in profile["host"]] == list(QUICK_ROWS) == [d["rows"] for d in profile["device"]]
    assert all(h["seconds"] > 0 and h["gflops"] > 0 for h in profile["host"] + profile["device"])
    assert profile["both"]["bus_gbps"] is None or profile["both"]["bus_gbps"] > 0
    assert profile["callback_s"] > 0  # a callback from a jitted step costs something on any device
    assert [r["rows"] for r in profile["device_dense"]] == list(QUICK_ROWS)
    assert all(r["seconds"] > 0 for r in profile["device_dense"])
    assert Profile.load(out).dense_time(16.0) > 0
    assert "bus host->device" in result.stdout and "a host callback from a jitted step" in result.stdout


def test_probe_reads_the_expert_shape_from_a_model(tmp_path):
    from pathlib import Path

    model = Path(__file__).resolve().parents[1] / "models" / "tiny-moe"
    out = tmp_path / "probe.json"
    cmd = [sys.executable, "-m", "moe_jax.probe", "--quick", "--model", str(model), "--repeats", "1", "--out", str(out)]
    assert subprocess.run(cmd, capture_output=True, text=True).returncode == 0
    assert json.loads(out.read_text())["expert"]["hidden"] == 128
