"""infer.py end to end on the bundled default model: output records, chat prompts, anchor reuse, bad input."""

import json
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import pytest

from host_kernels.fused_forward import best_kernel
from moe_jax.cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-moe"


def infer(*args, check=True):
    cmd = [sys.executable, str(ROOT / "infer.py"), "--model", str(MODEL), *map(str, args)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(result.stderr)
    return result


def refusal(capsys, *args, model=MODEL) -> str:
    """infer.py's refusal of `args` run in this process (each check here comes before anything loads, and a
    subprocess per case cost ~2.5 s of imports): asserts exit code 2 and returns what it printed to stderr."""
    import infer as infer_cli

    try:
        code = run_cli(infer_cli.main, ["--model", str(model), *map(str, args)])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    return err


def write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat(*turns):
    roles = ["user", "assistant"]
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


def test_outputs_in_input_order_with_reuse_of_shared_chat_prefixes(tmp_path):
    prompts = write(
        tmp_path / "p.jsonl",
        [
            {"prompt": "copy abc >"},
            chat("copy hello >", " hello", "sort dcba >"),
            chat("copy hello >", " hello", "sort dcba >", " abcd", "copy xyz >"),  # the same conversation, one turn on
            {"input_ids": [1, 20, 10, 21, 9, 42, 6, 7, 42, 43]},
        ],
    )
    out = tmp_path / "out.jsonl"
    result = infer("--prompts", prompts, "--out", out, "--batch-size", 2, "--anchor-cache-mb", 16)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["completion"].strip() == "abc"
    assert all(r["finish_reason"] == "eos" and r["completion_tokens"] == len(r["completion_ids"]) for r in rows)
    assert rows[2]["reused_prompt_tokens"] > 0  # the third prompt starts from the second one's anchors
    assert "anchor cache:" in result.stderr and "prefilled" in result.stderr


def test_too_long_prompts_are_rejected_or_truncated_and_counted(tmp_path):
    prompts = write(tmp_path / "p.jsonl", [{"prompt": "copy abc >"}, {"prompt": "copy " + "ab" * 100 + " >"}])
    out = tmp_path / "out.jsonl"
    result = infer("--prompts", prompts, "--out", out, "--max-new-tokens", 8)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[1] == {"line": 2, "finish_reason": "too_long", "completion": None}
    assert "0 truncated, 1 rejected" in result.stderr
    result = infer("--prompts", prompts, "--out", out, "--max-new-tokens", 8, "--too-long", "truncate")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[1]["prompt_tokens"] == 128 - 8 and "1 truncated, 0 rejected" in result.stderr


def test_malformed_line_is_named(tmp_path):
    prompts = write(tmp_path / "p.jsonl", [{"prompt": "copy a >"}, '{"prompt": "copy b >"'])
    result = infer("--prompts", prompts, check=False)
    assert result.returncode == 2
    assert f"error: {prompts}:2: malformed JSON" in result.stderr


def test_bad_sampling_refused_before_loading_the_model(tmp_path, capsys):
    for flags, message in (
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--temperature", "-1"], "temperature"),
        (["--seed", "-3"], "seed must be >= 0, got -3"),
        (["--stop", "x", "--stop", ""], "--stop must not be empty"),
    ):
        err = refusal(capsys, *flags, model=tmp_path / "no-such-model")
        assert message in err and "no-such-model" not in err


def test_adapter_for_another_base_is_refused(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    )
    import numpy as np

    from moe_jax.formats.safetensors_io import save_safetensors

    save_safetensors(
        adapter / "adapter_model.safetensors",
        {
            f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight": np.zeros((4, 256), np.float32)
            for i in range(2)
        }
        | {
            f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight": np.zeros((128, 4), np.float32)
            for i in range(2)
        },
    )
    result = infer("--adapter", adapter, check=False)
    assert result.returncode == 2
    assert "adapter does not fit" in result.stderr or "this model needs (128, 4)" in result.stderr


def test_auto_backend_with_a_memory_split_per_wave_gives_the_host_backends_output(tmp_path):
    prompts = write(
        tmp_path / "p.jsonl",
        [{"prompt": p} for p in ("copy abc >", "reverse hello >", "sort dcba >", "copy xy >", "reverse tub >")],
    )
    host_out, auto_out = tmp_path / "host.jsonl", tmp_path / "auto.jsonl"
    infer("--prompts", prompts, "--out", host_out, "--batch-size", 2)
    profile = ROOT / "tests" / "data" / "probe_2core_cpu.json"
    result = infer(
        "--prompts", prompts, "--out", auto_out, "--batch-size", 2, "--backend", "auto", "--profile", profile,
        "--device-memory-mb", 2, "--kv-fraction", "auto", "--wave-size", 2,
    )  # fmt: skip
    completions = [
        [json.loads(line)["completion_ids"] for line in f.read_text().splitlines()] for f in (host_out, auto_out)
    ]
    assert completions[0] == completions[1]
    assert "device memory 2.0 MiB: KV cache" in result.stderr


def test_speculative_decoding_gives_the_same_completions(tmp_path):
    # the bundled model copies its prompt's word: prompt-lookup drafts of the rest of the word are accepted
    words = ("abcdefgh", "hello", "mnopqrst", "xyzzy")
    prompts = write(tmp_path / "p.jsonl", [{"prompt": f"copy {w} >"} for w in words])
    plain_out, speculative_out = tmp_path / "plain.jsonl", tmp_path / "speculative.jsonl"
    infer("--prompts", prompts, "--out", plain_out, "--batch-size", 2)
    metrics = tmp_path / "metrics.jsonl"
    result = infer(
        "--prompts", prompts, "--out", speculative_out, "--batch-size", 2, "--draft-tokens", 7, "--metrics", metrics
    )  # fmt: skip
    completions = [
        [json.loads(line)["completion_ids"] for line in f.read_text().splitlines()]
        for f in (plain_out, speculative_out)
    ]
    assert completions[0] == completions[1]
    # whether drafts are verified at all is the cost policy's call on this machine: the summary says what it did
    summary = re.search(r"speculative decoding: (\d+) of (\d+) drafts accepted", result.stderr)
    assert summary
    # and each prompt's run record the drafts so far: the last one the run's
    records = [json.loads(line) for line in metrics.read_text().splitlines()][: len(words)]
    assert all("draft_acceptance" in r for r in records)
    accepted, drafted = (int(n) for n in summary.groups())
    assert records[-1]["drafted_tokens"] == drafted
    assert records[-1]["draft_acceptance"] == (accepted / drafted if drafted else None)


def test_hybrid_takes_device_experts_and_moves_them(tmp_path):
    prompts = write(tmp_path / "p.jsonl", [{"prompt": p} for p in ("copy abc >", "reverse hello >", "sort dcba >")])
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"0": [1, 2], "1": [0]}))
    host_out, hybrid_out = tmp_path / "host.jsonl", tmp_path / "hybrid.jsonl"
    infer("--prompts", prompts, "--out", host_out)
    result = infer("--prompts", prompts, "--out", hybrid_out, "--backend", "hybrid", "--device-experts", plan)
    completions = [
        [json.loads(line)["completion_ids"] for line in f.read_text().splitlines()] for f in (host_out, hybrid_out)
    ]
    assert completions[0] == completions[1]
    config = json.loads((MODEL / "config.json").read_text())
    expert_mib = 3 * config["hidden_size"] * config["intermediate_size"] * 4 / 2**20  # gate, up, down in float32
    assert f"hybrid: {3 * expert_mib:.1f} MiB of experts on the device" in result.stderr


def test_device_experts_refusals(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    for flags, content, message in (
        (["--backend", "hybrid"], None, "the hybrid backend needs the experts it keeps on the device"),
        (["--device-experts", bad], "{}", "--device-experts is for --backend hybrid"),
        (["--backend", "hybrid", "--device-experts", bad], "[1]", "a non-empty JSON object"),
        (["--backend", "hybrid", "--device-experts", bad], '{"x": [1]}', "'x' is not a layer number"),
        (["--backend", "hybrid", "--device-experts", bad], '{"0": [1.5]}', "layer 0: expected a list of expert ids"),
        (["--backend", "hybrid", "--device-experts", bad], "{", "not JSON"),
        (["--backend", "hybrid", "--device-experts", bad], '{"0": [9]}', "expert ids [9] outside [0, 4)"),
    ):
        if content is not None:
            bad.write_text(content)
        assert message in refusal(capsys, *flags)


def test_bad_memory_settings_refused_before_loading_the_model(tmp_path, capsys):
    for flags, message in (
        (["--kv-fraction", "0.5"], "--kv-fraction needs --device-memory-mb"),
        (["--device-memory-mb", "4", "--kv-fraction", "2"], "--kv-fraction must be in [0, 1]"),
        (["--device-memory-mb", "4", "--kv-fraction", "half"], "a number in [0, 1] or 'auto'"),
        (["--wave-size", "0"], "--wave-size must be >= 1"),
        (["--device-memory-mb", "nan"], "--device-memory-mb must be a finite number > 0, got nan"),
        (["--host-threads", "1000000"], "--host-threads must be in [1, 4096], got 1000000"),
        (["--draft-tokens", "16"], "--draft-tokens must be in [0, 15], got 16"),
    ):
        assert message in refusal(capsys, *flags, model=tmp_path / "no-such-model")


def test_an_unwritable_out_fails_before_loading_the_model(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = infer("--prompts", ROOT / "data" / "default_prompts.jsonl", "--out", blocker / "o.jsonl", check=False)
    assert result.returncode == 2 and "cannot write there" in result.stderr and "generating" not in result.stderr


def test_links_at_out_and_its_partial_are_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out.jsonl"
    out.symlink_to(victim)
    (tmp_path / "out.jsonl.partial").symlink_to(victim)
    infer("--prompts", write(tmp_path / "p.jsonl", [{"prompt": "copy ab >"}]), "--out", out)
    assert victim.read_text() == "precious" and not out.is_symlink()
    assert json.loads(out.read_text())["line"] == 1


def test_a_failure_part_way_keeps_the_finished_records(tmp_path, monkeypatch, capsys):
    import infer as infer_cli
    from moe_jax.generation.engine import GenerationEngine

    original = GenerationEngine.run

    def fails_after_the_first(self, requests, *args, on_finish=None, **kwargs):
        def finish_then_fail(index, done):
            on_finish(index, done)
            raise OSError("disk went away")

        return original(self, requests, *args, on_finish=finish_then_fail, **kwargs)

    monkeypatch.setattr(GenerationEngine, "run", fails_after_the_first)
    prompts = write(tmp_path / "p.jsonl", [{"prompt": "copy ab >"}, {"prompt": "copy cd >"}])
    out = tmp_path / "out.jsonl"
    with pytest.raises(OSError, match="disk went away"):
        infer_cli.main(["--model", str(MODEL), "--prompts", str(prompts), "--out", str(out), "--batch-size", "1"])
    assert not out.exists()
    kept = [json.loads(line) for line in (tmp_path / "out.jsonl.partial").read_text().splitlines()]
    assert len(kept) == 1 and kept[0]["completion"] is not None
    assert "finished record(s) are in" in capsys.readouterr().err


def test_extreme_sampling_settings_still_generate(tmp_path):
    """A top-k above the vocabulary keeps every token; a temperature of 1e-30 is greedy, not NaN; a batch size far
    above the number of prompts allocates the KV cache for the prompts only."""
    prompts = write(tmp_path / "p.jsonl", [{"prompt": "copy abc >"}, {"prompt": "copy xy >"}])
    greedy = infer("--prompts", prompts, "--max-new-tokens", "4").stdout
    tiny = infer("--prompts", prompts, "--max-new-tokens", "4", "--temperature", "1e-30", "--top-k", "100000")
    assert tiny.stdout == greedy
    assert infer("--prompts", prompts, "--max-new-tokens", "4", "--batch-size", "100000").stdout == greedy


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quant_generates_and_says_so(tmp_path, quant):
    prompts = write(tmp_path / "p.jsonl", [{"prompt": "copy abc >"}, {"prompt": "sort cab >"}])
    kernel = best_kernel(ml_dtypes.bfloat16, quant)[0]  # avx512-int8, avx2-int8, ...
    if not kernel:
        refused = infer("--prompts", prompts, "--quant", quant, check=False)
        assert refused.returncode == 2 and f"{quant} experts: no kernel on this machine" in refused.stderr
        return
    result = infer("--prompts", prompts, "--max-new-tokens", "4", "--dtype", "bfloat16", "--quant", quant)
    assert f"plan: experts {kernel} via FFI" in result.stderr and "dense native" in result.stderr
    assert result.stdout.count("->") == 2
