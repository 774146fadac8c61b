"""One process of tests/test_distributed.py's expert-parallel check: `python tests/expert_parallel_run.py OUT.npz
[MODEL]` alone computes the whole model; under `python -m moe_jax.launch -n N` each process holds 1/N of the
experts (sliced from MODEL's, or MODEL's own shard when it was converted with --expert-shards N) and its rows of
the batch. Process 0 writes logits [batch, seq, vocab], loss, the LoRA gradients and every process's
expert store bytes to OUT.npz."""

import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moe_jax  # noqa: E402
from moe_jax import distributed  # noqa: E402
from moe_jax.distributed import this_process_shard  # noqa: E402
from moe_jax.model.lora import LoRAConfig  # noqa: E402
from moe_jax.train.objective import lora_value_and_grad  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-moe"
BATCH, SEQ = 4, 12


def main(out: str, model_dir=MODEL):
    world = distributed.join()
    model = moe_jax.load_model(model_dir, expert_shard=this_process_shard(world.count), host_threads=1)
    model.attach_lora(LoRAConfig(rank=4, targets=("q_proj", "v_proj", "o_proj")), seed=0)
    value_and_grad, lora_state = lora_value_and_grad(model)
    rng = np.random.default_rng(0)  # LoRA B starts at zero: random weights make every gradient count
    leaves, treedef = jax.tree.flatten(lora_state)
    lora_state = jax.tree.unflatten(treedef, [rng.normal(0, 0.05, x.shape).astype(np.float32) for x in leaves])
    model.set_lora_state(lora_state)

    tokens = rng.integers(3, model.config.vocab_size, (BATCH, SEQ)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[:, :4] = 0
    mask[1, 6:] = 0  # processes with different numbers of targets
    rows = world.rows(BATCH)
    logits = distributed.gather(model.logits(tokens[rows])).reshape(BATCH, SEQ, -1)
    loss, grads = model.run_jitted(value_and_grad, lora_state, tokens[rows], mask[rows])
    store_bytes = distributed.gather(np.array([model.placement.runtime.compute.store.nbytes], np.float32))
    if world.is_main:
        flat = {f"grad/{i}": np.asarray(g) for i, g in enumerate(jax.tree.leaves(grads))}
        np.savez(out, logits=logits, loss=np.asarray(loss), store_bytes=store_bytes[:, 0], **flat)


if __name__ == "__main__":
    main(*sys.argv[1:])
