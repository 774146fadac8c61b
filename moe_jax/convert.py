"""`python -m moe_jax.convert --hf DIR --out DIR [--quant int8|int4]`: a Hugging Face checkpoint into the converted
format.

The converted directory holds config.json and tokenizer files as they were, the non-expert tensors in one
`model.safetensors` (Hugging Face names and layout), and the routed experts in an `experts/` store in the host
kernels' layout (with --quant, quantized and packed for their kernel), memory-mapped when loaded. It is written
into a directory of its own next to OUT (`OUT.partial-XXXX`), its store checksums verified, and renamed into
place at the end, so an interrupted conversion never leaves a directory that looks finished. An existing
non-empty OUT is refused unless --overwrite; OUT may not be or contain the source, nor lie inside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from host_kernels import QUANTIZED, ExpertStore, StoreError, StoreWriter
from moe_jax.checkpoint import EXPERT_STORE_DIR, is_expert_tensor, open_checkpoint
from moe_jax.cli import run_cli
from moe_jax.errors import CheckpointError, InputError
from moe_jax.safetensors_io import save_safetensors

SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def convert(
    hf_dir, out_dir, dtype: str | None = None, progress: bool = True, overwrite: bool = False, quant: str | None = None
) -> Path:
    """Writes the converted checkpoint of `hf_dir` to `out_dir` and returns it. `out_dir` must not exist or be
    empty, unless `overwrite` (then it is replaced, only once the new one is complete and verified). `quant` (a
    host_kernels.QUANTIZED name): the experts are stored quantized, packed for their kernel (`dtype` is then the
    one their products take rows in); the dense weights stay as they are."""
    if quant is not None and quant not in QUANTIZED:
        raise InputError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANTIZED)}")
    checkpoint = open_checkpoint(hf_dir)
    if checkpoint.is_converted:
        raise CheckpointError(f"{hf_dir}: already a converted directory")
    out_dir = Path(out_dir)
    check_destination(checkpoint.path, out_dir, overwrite)
    config = checkpoint.config
    if dtype is None:  # keep the checkpoint's precision
        sample = next((checkpoint.tensors.get(n) for n in checkpoint.tensors.names() if is_expert_tensor(n)), None)
        dtype = "bfloat16" if sample is not None and sample.dtype == ml_dtypes.bfloat16 else "float32"
    storage = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]

    # a directory of this run's own (a unique name: a sibling `OUT.partial` of someone else's is never touched)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.partial-", dir=out_dir.parent))
    except OSError as e:
        raise InputError(f"{out_dir}: cannot write there ({e.strerror or e})") from None
    try:
        partial.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the result should be like any new directory
        for name in SIDE_FILES:
            if (checkpoint.path / name).exists():
                shutil.copy2(checkpoint.path / name, partial / name)
        drop_fp8_quantization(partial / "config.json")  # the converted weights are dequantized
        dense = {n: checkpoint.tensors.get(n) for n in checkpoint.tensors.names() if not is_expert_tensor(n)}
        save_safetensors(partial / "model.safetensors", dense)
        writer = StoreWriter(partial / EXPERT_STORE_DIR, dtype, quant)
        desc = f"converting experts{f' to {quant}' if quant else ''}"
        for layer in tqdm(config.moe_layers, desc=desc, unit="layer", disable=not progress):
            stacked = checkpoint.layer_experts(layer, storage)
            try:
                writer.add_layer(layer, stacked.w13, stacked.w2)
            except StoreError as e:  # a weight that cannot be quantized, named
                raise CheckpointError(f"{checkpoint.path}: {e}") from None
        writer.close()
        ExpertStore.open(partial / EXPERT_STORE_DIR, verify=True)  # what landed on disk is what was written
        _move_into_place(partial, out_dir)
    except OSError as e:
        raise InputError(f"{out_dir}: writing the converted checkpoint failed ({e}); nothing was left behind") from e
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # this run's own directory, if it was not renamed into place
    return out_dir


def check_destination(source: Path, out_dir: Path, overwrite: bool):
    """Refuses an `--out` that would destroy the source or someone's files."""
    src, out = source.resolve(), out_dir.resolve()
    if out == src or src in out.parents:
        raise InputError(f"--out {out_dir} is {'the source' if out == src else 'inside the source'} {source}")
    if out in src.parents:
        raise InputError(f"--out {out_dir} contains the source checkpoint {source}")
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise InputError(f"--out {out_dir} exists and is not a directory")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise InputError(f"--out {out_dir} exists and is not empty; pass --overwrite to replace it")


def _move_into_place(partial: Path, out_dir: Path):
    """Renames the finished `partial` to `out_dir`; an existing `out_dir` is set aside first and removed only
    after, so there is no moment without one of the two complete."""
    if not out_dir.exists():
        partial.rename(out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.old-", dir=out_dir.parent))
    old.rmdir()
    out_dir.rename(old)
    partial.rename(out_dir)
    shutil.rmtree(old)


def drop_fp8_quantization(config_file: Path):
    """An FP8 checkpoint's config without its quantization_config: what convert writes from it is float (or the
    int format asked for), and a config still saying fp8 would describe weights that are not there."""
    config = json.loads(config_file.read_text())
    if config.pop("quantization_config", None) is not None:
        config_file.write_text(json.dumps(config, indent=2))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m moe_jax.convert", description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, type=Path, help="Hugging Face checkpoint directory")
    parser.add_argument("--out", required=True, type=Path, help="directory to write (must not exist or be empty)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="expert storage dtype (default: as stored)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (once the new one is done)")
    parser.add_argument(
        "--quant",
        choices=list(QUANTIZED),
        help="store the experts quantized: int8 (a scale per output column) or int4 (a scale per group of 32 k-rows, "
        "llama.cpp's Q4_0 rule; int4-g64 / int4-g128: groups of 64 / 128), packed for their kernel and memory-mapped "
        "as they are when loaded (int4: 0.28x the bfloat16 experts' bytes)",
    )
    args = parser.parse_args(argv)
    out = convert(args.hf, args.out, args.dtype, overwrite=args.overwrite, quant=args.quant)
    print(f"converted {args.hf} -> {out} (expert store checksums verified)")


if __name__ == "__main__":
    sys.exit(run_cli(main))
