"""train.py: parity with transformers + peft, exact resume after kill -9, PEFT round trip, bad inputs."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import moe_jax
from moe_jax import bundled
from moe_jax.formats.adapters import lora_modules
from moe_jax.formats.safetensors_io import SafetensorsFile
from moe_jax.train.config import TrainConfig
from moe_jax.train.loop import Trainer, load_run_data
from tests.hf_models import make_hf_model, save_hf_model, torch, transformers

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-moe"
TRAIN = ROOT / "data" / "reverse_train.jsonl"
EVAL = ROOT / "data" / "reverse_eval.jsonl"


def quick_config(out, **changes):
    settings = dict(
        model=str(MODEL),
        data=str(TRAIN),
        eval_data=str(EVAL),
        out=str(out),
        max_steps=12,
        batch_size=8,
        max_seq_len=24,
        eval_interval=1000,
        eval_exact_match=0,
        checkpoint_interval=1000,
        warmup_steps=0,
    )
    settings.update(changes)
    return TrainConfig(**settings).validate()


def tiny_family_model(variant, directory) -> Path:
    """A tiny random checkpoint of `variant` (tests/hf_models.py) over the bundled model's tokenizer, for runs on
    the bundled data."""
    hf = make_hf_model(variant, seed=4, vocab_size=50, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    save_hf_model(hf, directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL / name, directory / name)
    return directory


# bfloat16: both sides round weights and activations (adapters and AdamW stay float32 on both), each its own way:
# the first losses agree to 0.1%, and the rounding differences compound to ~2% over 12 steps at this learning rate.
# DeepSeek-V3: LoRA on the latent attention's projections (q_a/q_b, kv_a_proj_with_mqa, kv_b, o).
@pytest.mark.parametrize(
    "variant, dtype, rtol_first, rtol",
    [("tiny-moe", "float32", 1e-3, 1e-3), ("tiny-moe", "bfloat16", 2e-3, 4e-2), ("deepseek_v3", "float32", 1e-3, 1e-3)],
)
def test_losses_match_transformers_peft_step_for_step(tmp_path, variant, dtype, rtol_first, rtol):
    peft = pytest.importorskip("peft")
    model_dir = MODEL if variant == "tiny-moe" else tiny_family_model(variant, tmp_path / "model")
    targets = ["attention"] if variant != "tiny-moe" else None
    cfg = quick_config(
        tmp_path,
        model=str(model_dir),
        schedule="constant",
        learning_rate=3e-3,
        weight_decay=0.01,
        max_grad_norm=0.0,
        dtype=dtype,
        **({"lora_targets": targets} if targets else {}),
    )
    trainer = Trainer(cfg, load_run_data(cfg), progress=False)

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    peft_model = peft.get_peft_model(
        hf,
        peft.LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            target_modules=list(trainer.lora_config.targets),
            lora_dropout=0.0,
            bias="none",
        ),
    )
    modules = dict(peft_model.named_modules())
    with torch.no_grad():  # the same initial adapter on both sides
        for name, proj in lora_modules(trainer.model.transformer)[0]:
            module = modules[f"base_model.model.{name}"]
            module.lora_A["default"].weight.copy_(torch.from_numpy(np.asarray(proj.lora_a[...]).T.copy()))
            module.lora_B["default"].weight.copy_(torch.from_numpy(np.asarray(proj.lora_b[...]).T.copy()))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    ours, theirs = [], []
    for step in range(cfg.max_steps):
        tokens, mask = trainer.batches.batch(step)
        ours.append(trainer.step(step)[0])
        logits = peft_model(input_ids=torch.from_numpy(tokens).long()).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        target = torch.from_numpy(tokens[:, 1:]).long()
        m = torch.from_numpy(mask[:, 1:]).float()
        loss = -(logp.gather(-1, target[..., None])[..., 0] * m).sum() / m.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    assert ours[-1] < 0.9 * ours[0]  # it learns
    assert all(p.dtype == torch.float32 for p in params)  # peft's adapters, as ours, whatever the base dtype
    np.testing.assert_allclose(ours[:2], theirs[:2], rtol=rtol_first)
    np.testing.assert_allclose(ours, theirs, rtol=rtol)


def run_train(*args, check=True, **kwargs):
    cmd = [sys.executable, str(ROOT / "train.py"), "--no-progress", *map(str, args)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(result.stderr)
    return result


def adapter_tensors(run_dir):
    f = SafetensorsFile(Path(run_dir) / "adapter" / "adapter_model.safetensors")
    return {k: np.array(f.get(k)) for k in f.keys()}


COMMON = [
    "--max-steps",
    30,
    "--batch-size",
    8,
    "--max-seq-len",
    24,
    "--eval-interval",
    1000,
    "--eval-exact-match",
    0,
    "--checkpoint-interval",
    5,
]


def test_resume_after_kill_gives_the_same_adapter(tmp_path):
    result = run_train(*COMMON, "--out", tmp_path / "straight")
    assert re.search(r"held-out loss: \d+\.\d+ -> \d+\.\d+", result.stdout), result.stdout
    out = tmp_path / "killed"
    cmd = [sys.executable, str(ROOT / "train.py"), "--no-progress", *map(str, COMMON), "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (out / "checkpoints" / "10").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "adapter").exists(), "the run finished before it could be killed"
    run_train(*COMMON, "--out", out, "--resume")
    straight, resumed = adapter_tensors(tmp_path / "straight"), adapter_tensors(out)
    assert straight.keys() == resumed.keys()
    for key in straight:
        np.testing.assert_array_equal(resumed[key], straight[key])
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(31))  # each step recorded once


def test_exported_adapter_loads_in_peft_with_same_logits(tmp_path):
    peft = pytest.importorskip("peft")
    cfg = quick_config(tmp_path, max_steps=6, learning_rate=5e-3)
    Trainer(cfg, load_run_data(cfg), progress=False).run()
    ids = np.array([[1, 23, 10, 27, 10, 23, 24, 10, 42, 6, 7, 8, 42, 43]])
    ours = moe_jax.load_model(MODEL, backend="host", adapter=tmp_path / "adapter").logits(ids)
    base = moe_jax.load_model(MODEL, backend="host").logits(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(ours - base).max() > 1e-2  # the adapter changes the model
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    # a run directory works as adapter= too
    np.testing.assert_allclose(
        moe_jax.load_model(MODEL, backend="device", adapter=tmp_path).logits(ids), ours, atol=1e-5
    )


def test_adapter_for_another_base_is_refused(tmp_path):
    cfg = quick_config(tmp_path, max_steps=1)
    Trainer(cfg, load_run_data(cfg), progress=False).run()
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["r"] = 4  # tensors are rank 8: they no longer fit
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(moe_jax.CheckpointError, match="has shape .*this model needs"):
        moe_jax.load_model(MODEL, backend="host", adapter=tmp_path / "adapter")


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"instruction": "reverse abc >", "output": " cba"})


@pytest.mark.parametrize(
    "lines, extra, message",
    [
        ([GOOD, "{not json", GOOD], [], r"bad.jsonl:2: malformed JSON"),
        ([], [], r"bad.jsonl: no usable examples"),
        ([GOOD], ["--lora-targets", "q_proj,w_qkv"], r"unknown LoRA target module\(s\) \['w_qkv'\]"),
        ([GOOD], ["--learning-rate", "fast"], r"--learning-rate: invalid float value: 'fast'"),
        ([GOOD], ["--dtype", "float16"], r"dtype must be one of auto, float32, bfloat16, got 'float16'"),
        ([json.dumps({"question": "x"})], [], r"bad.jsonl:1: expected 'text'"),
        (
            [GOOD],
            ["--backend", "hybrid"],
            r"the hybrid backend needs the experts it keeps on the device: --device-experts FILE",
        ),
        ([GOOD], ["--device-experts", "experts.json"], r"--device-experts is for --backend hybrid, not 'host'"),
    ],
)
def test_bad_input_exits_2_before_compute(tmp_path, lines, extra, message):
    data = write_lines(tmp_path / "bad.jsonl", lines)
    result = run_train("--data", data, "--eval-data", EVAL, "--out", tmp_path / "run", *extra, check=False)
    assert result.returncode == 2
    assert any(re.search(message, line) for line in result.stderr.splitlines()), result.stderr
    assert not (tmp_path / "run").exists()  # nothing was computed or written


def test_skip_bad_lines_and_long_examples_are_counted(tmp_path):
    long = json.dumps({"instruction": "reverse abcdefghijk >", "output": " kjihgfedcba"})  # 33 tokens
    data = write_lines(tmp_path / "mixed.jsonl", [GOOD, "{oops", long, GOOD, long])
    cfg = quick_config(tmp_path, data=str(data), skip_bad_lines=True, long_examples="drop")
    run = load_run_data(cfg)
    assert (run.stats.skipped_lines, run.stats.dropped_too_long, len(run.train)) == (1, 2, 2)
    cfg = quick_config(tmp_path, data=str(data), skip_bad_lines=True, long_examples="truncate")
    run = load_run_data(cfg)
    assert (run.stats.truncated, len(run.train)) == (2, 4)
    assert all(len(e.ids) <= 24 for e in run.train)


def test_nan_loss_stops_with_step_and_keeps_checkpoint(tmp_path):
    import jax.numpy as jnp

    cfg = quick_config(tmp_path, max_steps=10, checkpoint_interval=2, eval_data=None, eval_fraction=0.0)
    trainer = Trainer(cfg, load_run_data(cfg), progress=False)
    original, calls = trainer.value_and_grad, []

    def nan_from_step_7(state, tokens, mask, key=None):
        loss, grads = original(state, tokens, mask, key)
        calls.append(1)
        return (jnp.float32(jnp.nan) if len(calls) >= 7 else loss), grads

    trainer.value_and_grad = nan_from_step_7
    with pytest.raises(moe_jax.MoeJaxError, match=r"step 7: loss is nan; stopping. The last good checkpoint"):
        trainer.run()
    assert trainer.checkpoints.latest_step() == 6
    fresh = Trainer(cfg, load_run_data(cfg), progress=False)
    assert fresh.resume() == 6  # still readable


def test_divergence_is_named_by_step(tmp_path):
    cfg = quick_config(tmp_path, max_steps=5, learning_rate=1e30, max_grad_norm=0.0, eval_data=None, eval_fraction=0.0)
    trainer = Trainer(cfg, load_run_data(cfg), progress=False)
    with pytest.raises(moe_jax.MoeJaxError, match=r"step [1-5]: (loss is|the update made LoRA|the model diverged)"):
        trainer.run()


def test_lora_dropout_is_seeded_and_changes_training(tmp_path):
    def losses(dropout, out):
        cfg = quick_config(out, max_steps=4, lora_dropout=dropout, learning_rate=5e-3)
        trainer = Trainer(cfg, load_run_data(cfg), progress=False)
        return [trainer.step(s)[0] for s in range(4)]

    plain = losses(0.0, tmp_path / "a")
    dropped = losses(0.3, tmp_path / "b")
    assert dropped == losses(0.3, tmp_path / "c")  # same seed, same masks
    assert dropped[0] == plain[0]  # B starts at zero: dropout cannot matter before the first update
    assert dropped[1:] != plain[1:]


@pytest.mark.parametrize(
    "record, targets",
    [
        ({"text": "copy ab > ab"}, "copy ab > ab</s>"),
        ({"instruction": "reverse ab", "input": "now", "output": " ba"}, " ba</s>"),
        (
            {
                "messages": [
                    {"role": "user", "content": "sort ba"},
                    {"role": "assistant", "content": "ab"},
                    {"role": "user", "content": "copy c"},
                    {"role": "assistant", "content": "c"},
                ]
            },
            "ab</s>c</s>",
        ),
    ],
)
def test_data_formats_mask_only_targets(record, targets):
    from moe_jax.formats.tokenizer import load_tokenizer
    from moe_jax.train.data import encode_record

    tok = load_tokenizer(MODEL)
    ex = encode_record(record, tok, "x: ")
    assert len(ex.ids) == len(ex.mask)
    assert tok.decode([i for i, m in zip(ex.ids, ex.mask, strict=True) if m], skip_special_tokens=False) == targets
    assert ex.ids[0] == tok.token_to_id("<s>")


def test_packing_keeps_targets_and_fills_rows():
    from moe_jax.train.data import Example, pack

    examples = [Example([1, 2, 3], [0, 1, 1]), Example([4, 5], [0, 1]), Example([6, 7, 8, 9], [0, 0, 1, 1])]
    rows = pack(examples, 6)
    assert [r.ids for r in rows] == [[1, 2, 3, 4, 5], [6, 7, 8, 9]]
    assert [r.mask for r in rows] == [[0, 1, 1, 0, 1], [0, 0, 1, 1]]


def test_bundled_configs_parse_and_default_matches_no_arguments(tmp_path):
    default = TrainConfig.from_sources(str(ROOT / "configs" / "default.toml"), {})
    paths = ("model", "data", "eval_data")  # the file's are relative to the checkout, the defaults the package's

    def resolved(config):
        return dataclasses.replace(config, **{k: str(Path(getattr(config, k)).resolve()) for k in paths})

    assert resolved(default) == resolved(TrainConfig().validate())
    mixtral = TrainConfig.from_sources(str(ROOT / "configs" / "mixtral-8x7b-chat-lora.toml"), {"max_steps": 5})
    assert mixtral.max_steps == 5 and mixtral.grad_accum == 8  # flags override the file
    deepseek = TrainConfig.from_sources(str(ROOT / "configs" / "deepseek-v2-lite-lora.toml"), {})
    assert deepseek.lora_targets == ["attention"] and deepseek.dtype == "bfloat16"
    bad = tmp_path / "bad.toml"
    bad.write_text("learning_rat = 0.1\n")
    with pytest.raises(moe_jax.ConfigError, match=r"bad.toml: unknown setting\(s\) \['learning_rat'\]"):
        TrainConfig.from_sources(str(bad), {})
    for old, new in (("device_budget_mb = 512", "device_memory_mb"), ('placement_plan = "p.json"', "device_experts")):
        bad.write_text(old + "\n")
        name = old.split(" ")[0]
        with pytest.raises(moe_jax.ConfigError, match=f"bad.toml: the setting '{name}' is now called '{new}'"):
            TrainConfig.from_sources(str(bad), {})


def test_own_data_is_evaluated_on_its_own_held_out_rows_unless_eval_data_is_given(tmp_path):
    default = TrainConfig.from_sources(None, {})
    assert (default.data, default.eval_data) == (str(bundled.TRAIN_DATA), str(bundled.EVAL_DATA))
    checkout = TrainConfig.from_sources(None, {"data": "data/reverse_train.jsonl"})  # the same file, linked
    assert Path(checkout.eval_data) == bundled.EVAL_DATA
    own = TrainConfig.from_sources(None, {"data": "mine.jsonl"})
    assert own.eval_data is None and own.eval_fraction > 0
    assert TrainConfig.from_sources(None, {"data": "mine.jsonl", "eval_data": "held.jsonl"}).eval_data == "held.jsonl"
    config = tmp_path / "run.toml"
    config.write_text('data = "mine.jsonl"\neval_data = "data/reverse_eval.jsonl"\n')
    assert TrainConfig.from_sources(str(config), {}).eval_data == "data/reverse_eval.jsonl"
