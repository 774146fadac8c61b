"""`python -m moe_jax.convert --hf DIR --out DIR`: a Hugging Face checkpoint into the converted format.

The converted directory holds config.json and tokenizer files as they were, the non-expert tensors in one
`model.safetensors` (Hugging Face names and layout), and the routed experts in an `experts/` store in the host
kernels' layout, memory-mapped when loaded. It is written under `OUT.partial` and renamed into place at the end,
so an interrupted conversion never leaves a directory that looks finished.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from host_kernels.store import StoreWriter
from moe_jax.checkpoint import EXPERT_STORE_DIR, is_expert_tensor, open_checkpoint
from moe_jax.cli import run_cli
from moe_jax.errors import CheckpointError
from moe_jax.safetensors_io import save_safetensors

SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def convert(hf_dir, out_dir, dtype: str | None = None, progress: bool = True) -> Path:
    checkpoint = open_checkpoint(hf_dir)
    if checkpoint.is_converted:
        raise CheckpointError(f"{hf_dir}: already a converted directory")
    out_dir = Path(out_dir)
    config = checkpoint.config
    if dtype is None:  # keep the checkpoint's precision
        sample = next((checkpoint.tensors.get(n) for n in checkpoint.tensors.names() if is_expert_tensor(n)), None)
        dtype = "bfloat16" if sample is not None and sample.dtype == ml_dtypes.bfloat16 else "float32"
    storage = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]

    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name in SIDE_FILES:
        if (checkpoint.path / name).exists():
            shutil.copy2(checkpoint.path / name, partial / name)
    dense = {n: checkpoint.tensors.get(n) for n in checkpoint.tensors.names() if not is_expert_tensor(n)}
    save_safetensors(partial / "model.safetensors", dense)

    writer = StoreWriter(partial / EXPERT_STORE_DIR, dtype)
    for layer in tqdm(config.moe_layers, desc="converting experts", unit="layer", disable=not progress):
        stacked = checkpoint.layer_experts(layer, storage)
        writer.add_layer(layer, stacked.w13, stacked.w2)
    writer.close()
    if out_dir.exists():
        shutil.rmtree(out_dir)
    partial.rename(out_dir)
    return out_dir


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m moe_jax.convert", description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, type=Path, help="Hugging Face checkpoint directory")
    parser.add_argument("--out", required=True, type=Path, help="directory to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="expert storage dtype (default: as stored)")
    args = parser.parse_args(argv)
    out = convert(args.hf, args.out, args.dtype)
    print(f"converted {args.hf} -> {out}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
