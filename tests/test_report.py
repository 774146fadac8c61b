"""Run figures: train.py and infer.py write them as JSONL records and TensorBoard scalars (read back with
TensorBoard's own reader), and `python -m moe_jax.report` draws them into an HTML page that a real browser
(Debian's Chromium, driven by playwright) renders with every plot present."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from moe_jax.cli import run_cli
from moe_jax.report import CURVES
from moe_jax.report import main as report_main
from moe_jax.train.loop import Trainer, load_run_data
from tests.test_train import quick_config

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = quick_config(out, max_steps=6, eval_interval=3, eval_exact_match=4, tensorboard=str(out / "tb"))
    Trainer(cfg, load_run_data(cfg), progress=False).run()
    return out


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def scalars(directory: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_train_writes_every_figure_to_metrics_and_tensorboard(train_run):
    steps = [r for r in records(train_run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for r in steps:
        assert r["lr"] > 0 and r["tokens_per_s"] > 0 and r["host_busy_pct"] > 0 and r["host_gflops"] > 0
        assert r["expert_skew"] >= 1.0 and r["bus_gbps"] > 0
    counted = [r for r in records(train_run / "metrics.jsonl") if "tokens_per_expert" in r]
    assert [r["step"] for r in counted] == [3, 6]  # at each evaluation: the counts since the previous one
    assert all(sum(map(sum, r["tokens_per_expert"].values())) > 0 for r in counted)
    tb = scalars(train_run / "tb")
    pairs = {
        "loss": "train/loss",
        "lr": "train/learning_rate",
        "host_busy_pct": "host/busy_pct",
        "bus_gbps": "bus/gbps",
        "expert_skew": "experts/max_over_mean",
        "device_wait_s": "wait/device_waits_for_host_s",
        "host_weight_gbps": "host/weight_gbps",
    }
    for key, tag in pairs.items():
        np.testing.assert_allclose([tb[tag][r["step"]] for r in steps], [r[key] for r in steps], rtol=1e-6)
    assert set(tb["train/held_out_loss"]) == {0, 3, 6}


def test_infer_writes_a_record_per_prompt_and_the_routing_at_the_end(tmp_path):
    import infer as infer_cli

    prompts = tmp_path / "prompts.jsonl"
    turns = [[{"role": "user", "content": text}] for text in ("copy ab", "sort dcba", "copy ab")]
    prompts.write_text("".join(json.dumps({"messages": t}) + "\n" for t in turns))
    args = ["--prompts", prompts, "--out", tmp_path / "out.jsonl", "--max-new-tokens", "4", "--anchor-cache-mb", "8"]
    args += ["--metrics", tmp_path / "metrics.jsonl", "--tensorboard", tmp_path / "tb", "--batch-size", "1"]
    infer_cli.main([str(a) for a in args])
    got = records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 3]
    assert all(r["completion_tokens"] > 0 and r["tokens_per_s"] > 0 for r in got[:3])
    assert got[2]["anchor_reused_tokens"] > 0  # the third prompt repeats the first
    assert sorted(got[-1]["tokens_per_expert"]) == ["0", "1"]
    assert set(scalars(tmp_path / "tb")["anchor_cache/reused_tokens"]) == {1, 2, 3}


def _render(run: Path, out: Path) -> tuple[list, Path]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(run.as_uri())
            images = page.evaluate("[...document.images].map(i => [i.alt, i.complete, i.naturalWidth])")
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()
    return images, out


@pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"),
    reason="no chromium (scripts/install_test_browser.sh installs Debian's)",
)
def test_report_renders_in_a_real_browser_with_every_plot(train_run, tmp_path):
    from PIL import Image

    assert CHROMIUM, "CI runs scripts/install_test_browser.sh: chromium must be there"
    assert run_cli(report_main, [str(train_run)]) in (None, 0)
    images, shot = _render(train_run / "report.html", tmp_path / "report.png")
    titles = [alt for alt, complete, width in images if complete and width > 0]
    # every curve the train records have (the anchor cache is infer's) and the expert heat map, all decoded
    assert titles == [title for title, *_ in CURVES if title != "Anchor cache"] + ["expert heat map"]
    picture = np.asarray(Image.open(shot).convert("RGB"))
    assert picture.shape[0] > 1500 and len(np.unique(picture.reshape(-1, 3), axis=0)) > 200  # drawn, not blank
    shutil.copy(shot, train_run / "report-screenshot.png")


def test_report_names_what_it_cannot_read(tmp_path, capsys):
    assert run_cli(report_main, [str(tmp_path / "missing")]) == 2
    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    assert run_cli(report_main, [str(bad)]) == 2
    assert "metrics.jsonl:2: not JSON" in capsys.readouterr().err
