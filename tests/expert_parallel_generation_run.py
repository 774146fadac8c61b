"""One process of tests/test_expert_parallel_generation.py's check: `python tests/expert_parallel_generation_run.py
OUT.json MODEL [QUANT]` alone generates with the whole model; under `python -m moe_jax.launch -n N` each process
holds 1/N of the experts and process 0 generates, the others following its steps. Process 0 writes the greedy,
sampled and speculative generations, and every process's expert store bytes, sums over processes and the bytes
it sent for them (and would have sent with every row), to OUT.json."""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moe_jax  # noqa: E402
from moe_jax import distributed  # noqa: E402
from moe_jax.distributed import this_process_shard  # noqa: E402
from moe_jax.generation import lockstep  # noqa: E402
from moe_jax.process_links import bytes_sent, sums_made  # noqa: E402

PROMPT_LENGTHS = (5, 9, 3, 14, 7)  # mixed lengths; 5 prompts in 4 slots: one waits for a row to finish


def generations(model) -> dict:
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [[int(t) for t in rng.integers(3, vocab, n)] for n in PROMPT_LENGTHS]
    repeating = [p * 3 for p in prompts[:2]]  # copied context: speculative steps keep drafts
    return {
        "greedy": model.generate(prompts, max_new_tokens=12),
        "sampled": model.generate(prompts, max_new_tokens=12, temperature=0.8, seed=7),
        "speculative": model.generate(repeating, max_new_tokens=16, draft_tokens=4),
    }


def main(out: str, model_dir: str, quant: str | None = None):
    world = distributed.join()
    model = moe_jax.load_model(model_dir, expert_shard=this_process_shard(world.count), host_threads=1, quant=quant)
    result = lockstep.run(model, lambda: generations(model))
    store_bytes = distributed.gather(np.array([model.placement.runtime.compute.store.nbytes], np.float64))[:, 0]
    sums = distributed.gather(np.array([sums_made(), *bytes_sent()], np.int64))
    if world.is_main:
        result.update(store_bytes=store_bytes.tolist(), sums=sums[:, 0].tolist(), sent=sums[:, 1:].tolist())
        Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
