"""Configs that would load and compute nonsense are refused with the key and value named; what a load or a
generation would allocate is checked against free memory before allocating (issue 15, items 8 and 12)."""

import json

import numpy as np
import pytest

import moe_jax
from host_kernels import choose_kernels
from moe_jax.errors import CheckpointError, ConfigError, MemoryLimitError
from moe_jax.formats.hf_config import read_hf_config
from moe_jax.planning.memory_check import check_fits, load_bytes
from tests.hf_models import make_hf_model, save_hf_model

QWEN3 = dict(
    model_type="qwen3_moe",
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=16,
    num_experts_per_tok=8,
    moe_intermediate_size=16,
    intermediate_size=48,
    max_position_embeddings=256,
)


def test_valid_config_reads_every_value():
    config = read_hf_config({**QWEN3, "rope_theta": 1e6, "sliding_window": None, "eos_token_id": [3, 4]})
    assert (config.num_layers, config.num_experts_per_tok, config.rope_theta) == (2, 8, 1e6)
    assert config.eos_token_ids == (3, 4) and config.sliding_windows == (None, None)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rms_norm_eps": 0}, "rms_norm_eps = 0 must be a finite number > 0"),
        ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps = '1e-6'"),
        ({"rope_theta": 0.0}, "rope_theta = 0.0 must be a finite number > 0"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -5}}, "rope_theta = -5"),
        ({"rope_parameters": "default"}, "rope_parameters = 'default' must be an object"),
        ({"sliding_window": -4, "use_sliding_window": True}, "sliding_window = -4 must be an integer >= 1"),
        ({"num_experts_per_tok": 2.7}, "num_experts_per_tok = 2.7 must be an integer >= 1"),
        ({"num_experts_per_tok": True}, "num_experts_per_tok = True"),
        ({"num_attention_heads": 0}, "num_attention_heads = 0 must be an integer >= 1"),
        ({"hidden_size": "32"}, "hidden_size = '32' must be an integer"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size = 0"),
        ({"vocab_size": -1}, "vocab_size = -1"),
        ({"num_hidden_layers": []}, "num_hidden_layers = []"),
        ({"mlp_only_layers": [5]}, "mlp_only_layers = [5] must be a list of layer indices in [0, 2)"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step = 0"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob = 'yes' must be true or false"),
        ({"max_position_embeddings": 0}, "max_position_embeddings = 0"),
        ({"eos_token_id": "</s>"}, "eos_token_id = '</s>' must be a token id"),
        ({"head_dim": None, "hidden_size": 30}, "hidden_size=30 is not a multiple of num_attention_heads=4"),
        ({"num_experts": None}, "missing key 'num_experts'"),
        ({"num_experts_per_tok": 17}, "num_experts_per_tok=17 must be between 1 and num_experts=16"),
        ({"num_hidden_layers": 2**70}, "num_hidden_layers = 1180591620717411303424 is beyond any real model"),
    ],
)
def test_nonsense_config_is_a_config_error(change, message):
    with pytest.raises(ConfigError) as info:
        read_hf_config({**QWEN3, **change}, source="model/config.json")
    assert "model/config.json" in str(info.value) or "num_experts_per_tok=" in str(info.value)
    assert message in str(info.value)


# MiniMax-M2's released config.json (MiniMaxAI/MiniMax-M2), its switches beside transformers' keys
MINIMAX_M2_RELEASE = dict(
    model_type="minimax_m2", vocab_size=200064, hidden_size=3072, num_hidden_layers=62, num_attention_heads=48,
    num_key_value_heads=8, head_dim=128, intermediate_size=1536, num_local_experts=256, num_experts_per_tok=8,
    rotary_dim=64, rope_theta=5000000, max_position_embeddings=196608, rms_norm_eps=1e-6, scoring_func="sigmoid",
    use_routing_bias=True, use_qk_norm=True, qk_norm_type="per_layer", shared_intermediate_size=0, use_mtp=True,
    num_mtp_modules=3, bos_token_id=None, eos_token_id=200020,
)  # fmt: skip


def test_minimax_m2_release_config_reads_as_transformers_computes_it():
    config = read_hf_config(MINIMAX_M2_RELEASE)
    assert (config.num_experts, config.num_experts_per_tok, config.expert_intermediate_size) == (256, 8, 1536)
    assert (config.rope.dim, config.rope.theta, config.qk_norm) == (64, 5e6, "full")
    assert (config.router.scores, config.router.bias, config.router.norm_topk_prob) == ("sigmoid", True, True)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"scoring_func": "softmax"}, "scoring_func = 'softmax' must be one of sigmoid"),
        ({"qk_norm_type": "per_head"}, "qk_norm_type = 'per_head' must be one of per_layer"),
        ({"use_routing_bias": False}, "use_routing_bias = False must be true"),
        ({"shared_intermediate_size": 512}, "shared_intermediate_size = 512 must be 0"),
        ({"rotary_dim": 127}, "partial_rotary_factor"),
    ],
)
def test_minimax_m2_settings_transformers_does_not_compute_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        read_hf_config({**MINIMAX_M2_RELEASE, **change}, source="m2/config.json")


def test_whole_float_counts_are_accepted():
    assert read_hf_config({**QWEN3, "num_experts_per_tok": 8.0}).num_experts_per_tok == 8


def test_config_that_is_not_an_object():
    with pytest.raises(ConfigError, match="expected a JSON object, got list"):
        read_hf_config([QWEN3])


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("mixtral", seed=3), tmp_path_factory.mktemp("mixtral"))


def with_config(src, dst, **changes):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


@pytest.mark.parametrize("layers, found", [(1, "layers 0..1"), (3, "layers 0..1"), (10**12, "layers 0..1")])
def test_layer_count_must_match_the_weights(checkpoint_dir, tmp_path, layers, found):
    path = with_config(checkpoint_dir, tmp_path / "m", num_hidden_layers=layers)
    with pytest.raises(CheckpointError, match=f"num_hidden_layers is {layers}, but the weights hold {found}"):
        moe_jax.load_model(path, backend="device")


def test_load_that_does_not_fit_is_refused_before_allocating(checkpoint_dir, monkeypatch):
    import moe_jax.planning.memory_check as memory_check

    monkeypatch.setattr(memory_check, "available_bytes", lambda: 1000)  # 1000 bytes free
    built = []
    monkeypatch.setattr(moe_jax.api, "make_placement", lambda *a, **k: built.append(a))
    with pytest.raises(
        MemoryLimitError, match=r"loading .* needs about .* KiB \(dense weights .*\) but this machine has 1000 bytes"
    ):
        moe_jax.load_model(checkpoint_dir, backend="host")
    assert not built


def test_a_load_that_int4_would_fit_says_so(checkpoint_dir, monkeypatch):
    import moe_jax.planning.memory_check as memory_check
    from moe_jax.formats.checkpoint import open_checkpoint

    parts = load_bytes(open_checkpoint(checkpoint_dir), 4, choose_kernels(np.float32))
    monkeypatch.setattr(memory_check, "available_bytes", lambda: sum(parts.values()) - 1)  # one byte short
    with pytest.raises(MemoryLimitError, match=r"with quant='int4' .* the host experts are held in [\d.]+ KiB"):
        moe_jax.load_model(checkpoint_dir, backend="host")
    with pytest.raises(MemoryLimitError) as refused:  # the device backend holds no host experts to quantize
        monkeypatch.setattr(memory_check, "available_bytes", lambda: 1000)
        moe_jax.load_model(checkpoint_dir, backend="device")
    assert "quant=" not in str(refused.value)


def test_load_estimate_counts_each_part(checkpoint_dir):
    from moe_jax.formats.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(checkpoint_dir)
    c = checkpoint.config
    experts = 3 * c.hidden_size * c.expert_intermediate_size * c.num_experts * c.num_layers * 4
    kernels = choose_kernels(np.float32)
    parts = load_bytes(checkpoint, 4, kernels)
    assert parts["experts"] == experts
    assert parts["packed expert copies"] == (experts if kernels.fused else 0)  # the AVX-512 forward packs
    assert load_bytes(checkpoint, 4, None)["packed expert copies"] == 0
    assert load_bytes(checkpoint, 4, choose_kernels(np.float32, native=False))["packed expert copies"] == 0
    embed = c.vocab_size * c.hidden_size * 4
    assert embed < parts["dense weights"] < 4 * embed + 2 * c.num_layers * 4 * c.hidden_size**2 * 4


def test_check_fits_names_the_parts():
    check_fits({"a": 10, "b": 20}, "x", available=30)
    with pytest.raises(
        MemoryLimitError, match=r"x needs about 3.0 MiB \(a 1.0 MiB, b 2.0 MiB\) but .* 2.0 MiB available"
    ):
        check_fits({"a": 1 << 20, "b": 2 << 20}, "x", available=2 << 20)


def test_kv_cache_is_sized_by_the_prompts_not_the_batch_size(checkpoint_dir, monkeypatch):
    model = moe_jax.load_model(checkpoint_dir, backend="device")
    sizes = []
    new_caches = model.kv.new_caches
    monkeypatch.setattr(model.kv, "new_caches", lambda batch, length: sizes.append(batch) or new_caches(batch, length))
    model.engine(64, 16).run(
        [moe_jax.generation.engine.Request([1, 2], 2, 0), moe_jax.generation.engine.Request([3], 2, 1)]
    )
    assert sizes == [2]


def test_kv_cache_that_does_not_fit_is_refused(checkpoint_dir, monkeypatch):
    import moe_jax.planning.memory_check as memory_check

    model = moe_jax.load_model(checkpoint_dir, backend="device")
    monkeypatch.setattr(memory_check, "available_bytes", lambda: 1000)
    with pytest.raises(MemoryLimitError, match="a KV cache of 2 sequences x 32 tokens needs about 16.0 KiB"):
        model.generate([[1, 2], [3]], max_new_tokens=2)


def test_train_max_seq_len_beyond_the_model_positions(checkpoint_dir, tmp_path):
    from moe_jax.train.config import TrainConfig
    from moe_jax.train.loop import check_sequence_length

    cfg = TrainConfig(model=str(checkpoint_dir), max_seq_len=257)
    with pytest.raises(ConfigError, match="max_seq_len 257 exceeds the model's max_position_embeddings 256"):
        check_sequence_length(cfg)
    check_sequence_length(TrainConfig(model=str(checkpoint_dir), max_seq_len=256))


def test_kimi_k2_reads_as_deepseek_v3():
    hf = {
        **{k: v for k, v in QWEN3.items() if k not in ("model_type", "num_experts", "head_dim")},
        "model_type": "kimi_k2",
        "n_routed_experts": 16,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": 8,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "first_k_dense_replace": 1,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    }  # fmt: skip
    config = read_hf_config(hf)
    assert config.model_type == "deepseek_v3" and config.mla.kv_lora_rank == 16 and config.dense_layers == (0,)
    assert config.rope.kind == "yarn" and config.rope.interleave and config.router.scores == "sigmoid"
    # DeepSeek's YaRN: 1 / sqrt(8 + 4) grows by mscale(factor, mscale_all_dim)^2 = (0.1 ln 32 + 1)^2
    assert config.softmax_scale == pytest.approx(12**-0.5 * (0.1 * np.log(32) + 1) ** 2)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_group": 3}, "n_group = 3 must be a divisor of the 16 routed experts"),
        ({"topk_group": 5, "n_group": 4}, "topk_group = 5 must be at most n_group = 4"),
        ({"qk_rope_head_dim": 5}, "qk_rope_head_dim = 5 must be even"),
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_type 'longrope' is not supported"),
        ({"rope_scaling": {"type": "linear"}}, "missing key 'factor'"),
    ],
)
def test_bad_deepseek_values_are_named(change, message):
    hf = {**{k: v for k, v in QWEN3.items() if k != "model_type"}, "model_type": "deepseek_v3", "n_routed_experts": 16}
    with pytest.raises(ConfigError, match=message):
        read_hf_config({**hf, **change}, source="m/config.json")
