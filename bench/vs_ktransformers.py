"""moe_jax's host experts against KTransformers' CPU MoE kernels (the kt-kernel wheel) on one MoE layer of a real
shape's dims, side by side in one process.

    pip install --no-deps kt-kernel==0.7.2  # beside the project: it runs on the project's torch
    python bench/vs_ktransformers.py [--shape qwen3-30b-a3b] [--formats bf16,int8,int4] [--tokens 1,16,512,2048]
                                     [--rounds 5] [--threads 2] [--sft-tokens 512] [--no-sft]

Where kt-kernel is not installed, it says so, writes a report that says so and exits 0.

Inference, per format: kt-kernel's own MoE classes (AMXBF16_MOE, AMXInt8_MOE, AMXInt4_MOE: its AMX kernels on a CPU
with AMX, its AVX-512 ones elsewhere; the variant it loaded is in the report), each quantizing the same bfloat16
weights its own way from `load_weights_task`, called as its own benchmarks call them (`forward_task` on its
CPUInfer, then `sync`), against moe_jax's fused forward (host_kernels/fused_forward.py) over the same weights
quantized as moe_jax quantizes them. The formats are not bit-for-bit the same: kt's int8 and int4 have one scale
per output column, moe_jax's int8 too but its int4 one per 32 k-rows (more scale bytes, far less error), and both
quantize the activations their own way; so each row also gives each side's relative error against a float64
reference on the bfloat16 weights. Every call routes each token to top-k distinct experts drawn uniformly afresh
(the same draws on both sides): a layer's experts come from DRAM as a real model's do, not from a cache that a
fixed routing would keep warm. Per round each side runs the case back to back, A B then B A; reported are each
side's median ms a call and tokens/s, and moe_jax's speed-up (kt's time over moe_jax's) as the median of the
rounds' own ratios with the lowest round's.

Training (`--sft-tokens`, bfloat16 base, int8 and int4 where kt has them): kt-kernel's SFT wrapper
(KTMoEWrapper(mode="sft"): AMXBF16_SFT, AMXINT8_SFT, AMXINT4_SFT; forward keeping what its backward needs, then the
backward: input, routing-weight and LoRA gradients) against moe_jax's ExpertCompute forward (keep=True) and
backward with the same expert LoRA (rank 8 on gate, up and down), same weights, tokens and routing.

Writes bench/results/vs_ktransformers[-SHAPE].json and bench/reports/vs_ktransformers[-SHAPE].md.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import (  # noqa: E402
    comma_choices,
    markdown_table,
    print_table,
    report_header,
    write_json,
    write_report,
)
from bench.models import SHAPES  # noqa: E402
from host_kernels import choose_kernels, default_threads  # noqa: E402
from host_kernels.compute import ExpertCompute  # noqa: E402
from host_kernels.host_moe import HostMoE  # noqa: E402
from host_kernels.layer_experts import LayerExperts, quantize_layer  # noqa: E402
from host_kernels.lora import ExpertLoRA  # noqa: E402
from host_kernels.store import ExpertStore  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
KT_CLASSES = {"bf16": "AMXBF16_MOE", "int8": "AMXInt8_MOE", "int4": "AMXInt4_MOE"}
KT_SFT_METHODS = {"bf16": "AMXBF16_SFT", "int8": "AMXINT8_SFT", "int4": "AMXINT4_SFT"}
QUANT = {"bf16": None, "int8": "int8", "int4": "int4"}
ROUTINGS = 8  # routing draws per case, taken in turn call after call
LORA_RANK, LORA_ALPHA = 8, 16.0
MIN_SECONDS = 0.25  # per side and round: enough calls to span it
ERROR_TOKENS = 4  # tokens of the float64 reference check


def moe_dims(shape: str) -> dict:
    """The routed experts' dims of a bench/models.py shape: experts, top_k, hidden, ffn."""
    settings = SHAPES[shape][2]
    experts = next(settings[k] for k in ("num_experts", "n_routed_experts", "num_local_experts") if k in settings)
    ffn = settings.get("moe_intermediate_size", settings.get("intermediate_size"))
    return {"experts": experts, "top_k": settings["num_experts_per_tok"], "hidden": settings["hidden_size"], "ffn": ffn}


def load_kt():
    """kt_kernel, or None with why."""
    try:
        import kt_kernel
    except ImportError as e:
        return None, f"kt-kernel is not installed ({e}): pip install --no-deps kt-kernel==0.7.2"
    return kt_kernel, ""


class Layer:
    """One layer's random bfloat16 experts, as kt-kernel takes them (torch [e, out, in]) and as moe_jax does."""

    def __init__(self, rng, dims: dict):
        import torch

        e, d, f = dims["experts"], dims["hidden"], dims["ffn"]
        self.dims = dims
        scale = np.float32(0.02)
        gate, up = ((rng.standard_normal((e, d, f), np.float32) * scale).astype(BF16) for _ in range(2))
        down = (rng.standard_normal((e, f, d), np.float32) * scale).astype(BF16)
        self.experts = LayerExperts(np.concatenate([gate, up], axis=2), down)  # w13 [e, d, 2f], w2 [e, f, d]

        def torch_bf16(a):  # [e, in, out] -> [e, out, in]
            return torch.from_numpy(np.ascontiguousarray(a.transpose(0, 2, 1)).view(np.int16)).view(torch.bfloat16)

        self.gate, self.up, self.down = torch_bf16(gate), torch_bf16(up), torch_bf16(down)

    def reference(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """float64 y of bfloat16 rows x through the bfloat16 experts, unquantized."""
        f = self.dims["ffn"]
        w13, w2 = self.experts.w13, self.experts.w2
        y = np.zeros((x.shape[0], x.shape[1]))
        x64 = x.astype(np.float64)
        for t in range(x.shape[0]):
            for e, w in zip(ids[t], weights[t], strict=True):
                h = x64[t] @ w13[e].astype(np.float64)
                g, u = h[:f], h[f:]
                y[t] += w * ((g / (1 + np.exp(-g)) * u) @ w2[e].astype(np.float64))
        return y


def routings(rng, tokens: int, dims: dict, count: int = ROUTINGS):
    """`count` draws of (bfloat16 x, top-k distinct expert ids, routing weights) for `tokens` tokens."""
    e, k = dims["experts"], dims["top_k"]
    draws = []
    for _ in range(count):
        x = rng.standard_normal((tokens, dims["hidden"]), np.float32).astype(BF16)
        ids = np.argsort(rng.random((tokens, e)), axis=1)[:, :k].astype(np.int64)
        weights = rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32)
        draws.append((x, ids, weights))
    return draws


def relative_error(y: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(y, np.float64) - reference) / np.linalg.norm(reference))


class KtSide:
    """kt-kernel's MoE class for one format over the layer, on its CPUInfer (its own benchmarks' calls)."""

    def __init__(self, kt, cpu, layer: Layer, fmt: str, max_tokens: int):
        import torch

        ext = kt.kt_kernel_ext
        dims = layer.dims
        self.torch, self.cpu, self.top_k = torch, cpu, dims["top_k"]
        self.mask = torch.zeros(dims["experts"], dtype=torch.bool)
        config = ext.moe.MOEConfig(dims["experts"], dims["top_k"], dims["hidden"], dims["ffn"], self.mask.data_ptr())
        config.layer_idx, config.pool, config.max_len = 0, cpu.backend_, max_tokens
        config.save, config.load = True, False  # quantize the bfloat16 weights given here
        config.gate_proj, config.up_proj, config.down_proj = (t.data_ptr() for t in (layer.gate, layer.up, layer.down))
        self._scratch = tempfile.TemporaryDirectory()
        config.path = self._scratch.name
        self.moe = getattr(ext.moe, KT_CLASSES[fmt])(config)
        self._logical = torch.arange(dims["experts"], dtype=torch.long)
        cpu.submit(self.moe.load_weights_task(self._logical.data_ptr()))
        cpu.sync()
        self._inputs = {}

    def prepare(self, draws):
        """Torch views of the draws (kt reads torch's pointers), made once outside the timed calls."""
        t = self.torch
        self._inputs = {
            i: (t.from_numpy(x.view(np.int16)).view(t.bfloat16), t.from_numpy(ids), t.from_numpy(w),
                t.zeros(x.shape, dtype=t.bfloat16), t.tensor([x.shape[0]], dtype=t.int32))
            for i, (x, ids, w) in enumerate(draws)
        }  # fmt: skip

    def __call__(self, i: int):
        x, ids, w, out, tokens = self._inputs[i]
        task = self.moe.forward_task(
            tokens.data_ptr(), self.top_k, ids.data_ptr(), w.data_ptr(), x.data_ptr(), out.data_ptr(), False
        )
        self.cpu.submit(task)
        self.cpu.sync()
        return out

    def output(self, i: int) -> np.ndarray:
        return self(i).view(self.torch.int16).numpy().view(BF16).astype(np.float32)


def moe_jax_engine(layer: Layer, fmt: str, threads: int) -> HostMoE:
    """moe_jax's host engine over the layer, its experts quantized as moe_jax quantizes them for `fmt`."""
    quant = QUANT[fmt]
    experts = layer.experts if quant is None else quantize_layer(layer.experts, quant)
    return HostMoE(ExpertStore({0: experts}, dtype=BF16), threads, kernels=choose_kernels(BF16, quant=quant))


class MoeJaxSide:
    """moe_jax's fused forward over the same layer, quantized as moe_jax quantizes it."""

    def __init__(self, layer: Layer, fmt: str, threads: int):
        self.fused = moe_jax_engine(layer, fmt, threads).fused_forward()
        if self.fused is None:
            raise RuntimeError(f"no fused {fmt} forward on this CPU")
        self.kernel = self.fused.kernel
        self._draws = []

    def prepare(self, draws):
        self._draws = [(x, ids.astype(np.int32), w) for x, ids, w in draws]

    def __call__(self, i: int):
        x, ids, w = self._draws[i]
        return self.fused.forward(0, x, ids, w)

    def output(self, i: int) -> np.ndarray:
        return self(i).astype(np.float32)


def timed_calls(side, calls: int) -> float:
    """Seconds a call over `calls` calls, the routing draws taken in turn."""
    start = time.perf_counter()
    for c in range(calls):
        side(c % ROUTINGS)
    return (time.perf_counter() - start) / calls


def calls_a_round(kt_side, ours) -> int:
    """Calls enough for the slower side's round to span MIN_SECONDS, after both sides' first calls (buffers, page
    faults)."""
    kt_side(0), ours(0)
    return max(2, int(MIN_SECONDS / max(timed_calls(ours, 2), timed_calls(kt_side, 2))))


def interleaved(kt_side, ours, rounds: int, calls: int) -> dict:
    """Both sides' seconds a call over `rounds` rounds of `calls` calls (A B, then B A)."""
    seconds = {"kt": [], "ours": []}
    for r in range(rounds):
        order = (("kt", kt_side), ("ours", ours)) if r % 2 == 0 else (("ours", ours), ("kt", kt_side))
        for name, side in order:
            seconds[name].append(timed_calls(side, calls))
    return seconds


def speed_row(seconds: dict, tokens: int) -> dict:
    ratios = [k / o for k, o in zip(seconds["kt"], seconds["ours"], strict=True)]
    kt_s, ours_s = statistics.median(seconds["kt"]), statistics.median(seconds["ours"])
    return {
        "kt_ms": kt_s * 1e3,
        "moe_jax_ms": ours_s * 1e3,
        "kt_tok_s": tokens / kt_s,
        "moe_jax_tok_s": tokens / ours_s,
        "speedup": statistics.median(ratios),
        "speedup_lowest": min(ratios),
    }


def inference_rows(kt, rng, layer: Layer, formats, tokens_list, rounds: int, threads: int) -> list[dict]:
    ext = kt.kt_kernel_ext
    config = ext.WorkerPoolConfig()
    config.subpool_count, config.subpool_numa_map, config.subpool_thread_count = 1, [0], [threads]
    cpu = ext.CPUInfer(config)
    max_tokens = -(-max(tokens_list) // 512) * 512  # kt's buffers take a multiple of its row blocks
    rows = []
    for fmt in formats:
        kt_side, ours = KtSide(kt, cpu, layer, fmt, max_tokens), MoeJaxSide(layer, fmt, threads)
        check = routings(rng, ERROR_TOKENS, layer.dims, count=1)
        reference = layer.reference(*check[0])
        kt_side.prepare(check), ours.prepare(check)
        errors = {"kt_error": relative_error(kt_side.output(0), reference)}
        errors["moe_jax_error"] = relative_error(ours.output(0), reference)
        for tokens in tokens_list:
            draws = routings(rng, tokens, layer.dims)
            kt_side.prepare(draws), ours.prepare(draws)
            seconds = interleaved(kt_side, ours, rounds, calls_a_round(kt_side, ours))
            row = {"format": fmt, "tokens": tokens, **speed_row(seconds, tokens)}
            rows.append({**row, **errors, "kt_class": KT_CLASSES[fmt], "moe_jax_kernel": ours.kernel})
            print_table(f"{fmt}, {tokens} tokens", [rows[-1]])
        del kt_side, ours
        gc.collect()
    del cpu  # its threads end here, before the training side starts its own
    gc.collect()
    return rows


def lora_pair(rng, experts: int, fan_in: int, fan_out: int):
    a = (rng.standard_normal((experts, fan_in, LORA_RANK), np.float32) * 0.01).astype(BF16).astype(np.float32)
    b = (rng.standard_normal((experts, LORA_RANK, fan_out), np.float32) * 0.01).astype(BF16).astype(np.float32)
    return a, b


class KtTraining:
    """kt-kernel's SFT wrapper over the layer in one format, its expert LoRA set to `lora`."""

    def __init__(self, kt, layer: Layer, fmt: str, lora: ExpertLoRA, tokens: int, threads: int):
        import torch

        dims = layer.dims
        self.torch = torch
        self._scratch = tempfile.TemporaryDirectory()
        self.wrapper = kt.KTMoEWrapper(
            layer_idx=0, num_experts=dims["experts"], num_experts_per_tok=dims["top_k"], hidden_size=dims["hidden"],
            moe_intermediate_size=dims["ffn"], gpu_experts_mask=None, cpuinfer_threads=threads, threadpool_count=1,
            weight_path=self._scratch.name, chunked_prefill_size=tokens, method=KT_SFT_METHODS[fmt], mode="sft",
            lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA,
        )  # fmt: skip
        self.wrapper.load_weights_from_tensors(layer.gate, layer.up, layer.down, torch.arange(dims["experts"]))

        def kt_pair(pair):  # moe_jax's A [e, in, r], B [e, r, out] -> kt's A [e, r, in], B [e, out, r], bfloat16
            return [self._bf16(np.ascontiguousarray(m.transpose(0, 2, 1))) for m in pair]

        self._lora = [*kt_pair(lora.gate), *kt_pair(lora.up), *kt_pair(lora.down)]
        self._grads = [torch.zeros_like(t) for t in self._lora]
        self.wrapper.init_lora_weights(*self._lora, *self._grads)

    def _bf16(self, a: np.ndarray):
        t = self.torch
        return t.from_numpy(np.ascontiguousarray(a.astype(BF16)).view(np.int16)).view(t.bfloat16)

    def prepare(self, x, ids, weights, dy):
        t = self.torch
        self._args = (self._bf16(x), t.from_numpy(ids), t.from_numpy(weights), self._bf16(dy))

    def __call__(self, _=None):
        x, ids, weights, dy = self._args
        self.wrapper.forward(x, ids, weights, save_for_backward=True)
        return self.wrapper.backward(dy)


class MoeJaxTraining:
    """moe_jax's ExpertCompute forward (keeping) and backward with the same expert LoRA."""

    def __init__(self, layer: Layer, fmt: str, lora: ExpertLoRA, threads: int):
        self.compute, self.lora = ExpertCompute(moe_jax_engine(layer, fmt, threads)), lora

    def prepare(self, x, ids, weights, dy):
        self._args = (x, ids.astype(np.int32), weights, dy)

    def __call__(self, _=None):
        x, ids, weights, dy = self._args
        _, saved = self.compute.forward(0, x, ids, weights, self.lora, keep=True)
        return self.compute.backward(0, x, ids, weights, dy, self.lora, saved)


def training_rows(kt, rng, layer: Layer, formats, tokens: int, rounds: int, threads: int) -> list[dict]:
    dims = layer.dims
    e, d, f = dims["experts"], dims["hidden"], dims["ffn"]
    lora = ExpertLoRA(LORA_ALPHA / LORA_RANK, lora_pair(rng, e, d, f), lora_pair(rng, e, d, f), lora_pair(rng, e, f, d))
    x, ids, weights = routings(rng, tokens, dims, count=1)[0]
    dy = rng.standard_normal(x.shape, np.float32).astype(BF16)
    rows = []
    for fmt in formats:
        row = {"format": fmt, "tokens": tokens, "kt_method": KT_SFT_METHODS[fmt]}
        try:
            kt_side = KtTraining(kt, layer, fmt, lora, tokens, threads)
        except (RuntimeError, ValueError, NotImplementedError) as error:  # a method this wheel or CPU lacks
            rows.append({**row, "kt_error": " ".join(str(error).split())[:200]})
            print_table(f"training, {fmt}", [rows[-1]])
            continue
        ours = MoeJaxTraining(layer, fmt, lora, threads)
        kt_side.prepare(x, ids, weights, dy), ours.prepare(x, ids, weights, dy)
        kt_dx, ours_dx = kt_side()[0], ours()[0]  # first calls (buffers, kt's backward repack), compared
        row["dx_difference"] = relative_error(
            kt_dx.view(kt_side.torch.int16).numpy().view(BF16).astype(np.float32), ours_dx.astype(np.float64)
        )
        rows.append({**row, **speed_row(interleaved(kt_side, ours, rounds, calls=1), tokens)})
        print_table(f"training, {fmt}", [rows[-1]])
        del kt_side, ours
        gc.collect()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=[s for s in SHAPES if s != "bench"], default="qwen3-30b-a3b")
    parser.add_argument("--formats", default="bf16,int8,int4", help="comma-separated, from bf16, int8, int4")
    parser.add_argument("--tokens", default="1,16,512,2048", help="comma-separated token counts a call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--sft-tokens", type=int, default=512, help="tokens of the training comparison")
    parser.add_argument("--no-sft", action="store_true", help="leave the training comparison out")
    args = parser.parse_args()
    formats = comma_choices(parser, args.formats, KT_CLASSES, "--formats")
    tokens_list = [int(t) for t in args.tokens.split(",")]
    dims = moe_dims(args.shape)
    name = f"vs_ktransformers-{args.shape}"
    title = f"moe_jax against kt-kernel: one MoE layer of {args.shape}'s dims, {args.threads} threads"
    kt, why = load_kt()
    if kt is None:
        print(f"skipped: {why}")
        write_report(name, [*report_header(title), "", f"Not run: {why}."])
        return
    variant = f"kt-kernel {getattr(kt, '__version__', '?')}, variant {kt.__cpu_variant__}, int8 {kt.__int8_kernel__}"
    rng = np.random.default_rng(0)
    layer = Layer(rng, dims)
    rows = inference_rows(kt, rng, layer, formats, tokens_list, args.rounds, args.threads)
    train = [] if args.no_sft else training_rows(kt, rng, layer, formats, args.sft_tokens, args.rounds, args.threads)
    write_json(name, {"dims": dims, "kt": variant, "threads": args.threads, "inference": rows, "training": train})
    lines = [
        *report_header(title),
        "",
        f"{variant}; layer {dims}; uniform routing drawn afresh each call; {args.rounds} interleaved rounds, "
        "medians; `speedup`: kt's time over moe_jax's (the median of the rounds' ratios, the lowest beside it); "
        f"`*_error`: relative error against a float64 reference on {ERROR_TOKENS} tokens (bench/vs_ktransformers.py "
        "says why they differ).",
        "",
        *markdown_table(rows),
    ]
    if train:
        lines += [
            "",
            f"Training: forward keeping what the backward needs, then the backward (input, routing-weight and "
            f"LoRA gradients), expert LoRA rank {LORA_RANK} on gate, up and down, bfloat16 base or kt's and "
            "moe_jax's quantized ones; `dx_difference`: the two sides' input gradients' relative difference.",
            "",
            *markdown_table(train),
        ]
    write_report(name, lines)


if __name__ == "__main__":
    main()
