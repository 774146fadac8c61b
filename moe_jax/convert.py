"""`python -m moe_jax.convert --hf DIR | --gguf FILE --out DIR [--quant int8|int4|none]`: a Hugging Face checkpoint
or a GGUF file into the converted format.

How it works and why: docs/INTERNALS.md, moe_jax/convert.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from host_kernels import QUANTIZED, ExpertStore, StoreError, StoreWriter
from moe_jax.cli import prog, run_cli
from moe_jax.distributed import ExpertShard
from moe_jax.errors import CheckpointError, ConfigError, InputError
from moe_jax.formats.checkpoint import EXPERT_STORE_DIR, SIDE_FILES, open_checkpoint, shard_store_name
from moe_jax.formats.gguf_checkpoint import GGUFFile, is_gguf_file
from moe_jax.formats.gguf_tokenizer import tokenizer_files
from moe_jax.formats.hf_names import is_expert_tensor
from moe_jax.formats.hub import resolve_model
from moe_jax.formats.safetensors_io import save_safetensors, write_safetensors
from moe_jax.output_files import current_umask

GGUF_CLOSEST = "closest"  # convert's default `quant`: a GGUF file's own format where moe_jax has it, else floats


def convert(
    source,
    out_dir,
    dtype: str | None = None,
    progress: bool = True,
    overwrite: bool = False,
    quant: str | None = GGUF_CLOSEST,
    expert_shards: int = 1,
) -> Path:
    """Writes the converted checkpoint of `source` (a Hugging Face directory or a .gguf file) to `out_dir` and
    returns it. `out_dir` must not exist or be empty, unless `overwrite` (then it is replaced, only once the new one
    is complete and verified). `quant` (a host_kernels.QUANTIZED name): the experts are stored quantized, packed for
    their kernel (`dtype` is then the one their products take rows in); the dense weights stay as they are (a GGUF
    file's in `dtype`, but what it holds as F32: write_dense). None:
    float experts; by default a GGUF file's experts take the format closest to theirs (see the module's doc), and
    an MXFP4 release's stay MXFP4.
    `expert_shards` N > 1: the experts in N stores of 1/N of every layer's (expert parallel)."""
    checkpoint = open_checkpoint(resolve_model(source))
    gguf_file = checkpoint.tensors if isinstance(checkpoint.tensors, GGUFFile) else None
    if quant == GGUF_CLOSEST:
        quant = checkpoint.shipped_quant()
    if quant is not None and quant not in QUANTIZED:
        raise InputError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANTIZED)}")
    if checkpoint.is_converted:
        raise CheckpointError(f"{source}: already a converted directory")
    out_dir = Path(out_dir)
    check_destination(checkpoint.path, out_dir, overwrite)
    config = checkpoint.config
    if expert_shards < 1:
        raise InputError(f"--expert-shards must be >= 1, got {expert_shards}")
    shards = [ExpertShard(i, expert_shards) for i in range(expert_shards)] if expert_shards > 1 else [None]
    try:
        shard_experts = [s.experts(config.num_experts) if s else None for s in shards]
    except ConfigError as e:
        raise InputError(str(e)) from None
    if dtype is None:  # keep the checkpoint's precision
        dtype = checkpoint.own_dtype()
    storage = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]

    # a directory of this run's own (a unique name: a sibling `OUT.partial` of someone else's is never touched)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.partial-", dir=out_dir.parent))
    except OSError as e:
        raise InputError(f"{out_dir}: cannot write there ({e.strerror or e})") from None
    try:
        partial.chmod(0o777 & ~current_umask())  # mkdtemp makes it private; the result should be like any new directory
        if gguf_file is not None:
            write_gguf_side_files(gguf_file, partial)
        else:
            for name in SIDE_FILES:
                if (checkpoint.path / name).exists():
                    shutil.copy2(checkpoint.path / name, partial / name)
            drop_fp8_quantization(partial / "config.json")  # the converted weights are dequantized
        write_dense(checkpoint, partial / "model.safetensors", storage)
        stores = [partial / (shard_store_name(s) if s else EXPERT_STORE_DIR) for s in shards]
        writers = [StoreWriter(store, dtype, quant) for store in stores]
        desc = f"converting experts{f' to {quant}' if quant else ''}"
        repacked = 0
        for layer in tqdm(config.moe_layers, desc=desc, unit="layer", disable=not progress):
            for writer, experts in zip(writers, shard_experts, strict=True):
                try:
                    if quant is None:
                        stacked = checkpoint.layer_experts(layer, storage, experts)
                        writer.add_layer(layer, stacked.w13, stacked.w2)
                        continue
                    quantized, as_stored = checkpoint.quantized_layer(layer, quant, storage, experts)
                    writer.add_quantized_layer(layer, quantized)
                    repacked += as_stored
                except StoreError as e:  # weights the store cannot take, named
                    raise CheckpointError(f"{checkpoint.path}: {e}") from None
        for writer, store in zip(writers, stores, strict=True):
            writer.close()
            ExpertStore.open(store, verify=True)  # what landed on disk is what was written
        _move_into_place(partial, out_dir)
        if gguf_file is not None and progress:
            print(gguf_summary(gguf_file, quant, repacked // len(shards), len(config.moe_layers)), file=sys.stderr)
    except OSError as e:
        raise InputError(f"{out_dir}: writing the converted checkpoint failed ({e}); nothing was left behind") from e
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # this run's own directory, if it was not renamed into place
    return out_dir


def write_dense(checkpoint, path: Path, storage):
    """The checkpoint's non-expert tensors into `path`: a GGUF file's one at a time in `storage` (float32 where the
    file holds them so: GGUFFile.dense_layout), a Hugging Face checkpoint's as they are stored."""
    names = [n for n in checkpoint.tensors.names() if not is_expert_tensor(n)]
    if not isinstance(checkpoint.tensors, GGUFFile):
        save_safetensors(path, {n: checkpoint.tensors.get(n) for n in names})
        return
    layout = checkpoint.tensors.dense_layout(names, storage)
    write_safetensors(path, layout, lambda name: np.asarray(checkpoint.tensors.get(name), layout[name][1]))


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


def write_gguf_side_files(gguf_file: GGUFFile, directory: Path):
    """config.json and, when the file has a tokenizer, tokenizer.json / tokenizer_config.json from its metadata."""
    (directory / "config.json").write_text(json.dumps(gguf_file.hf_config, indent=2))
    for name, text in (tokenizer_files(gguf_file) or {}).items():
        (directory / name).write_text(text)


def gguf_summary(gguf_file: GGUFFile, quant: str | None, repacked: int, layers: int) -> str:
    stored = gguf_file.experts_type()
    if quant is None:
        return f"experts: {stored} in the GGUF file, stored as floats"
    how = f"{repacked} of {layers} layers repacked from Q4_0 value for value" if repacked else "requantized"
    return f"experts: {stored} in the GGUF file, stored {quant} ({how})"


def drop_fp8_quantization(config_file: Path):
    """An FP8 checkpoint's config without its quantization_config: what convert writes from it is float (or the
    int format asked for), and a config still saying fp8 would describe weights that are not there."""
    config = json.loads(config_file.read_text())
    if config.pop("quantization_config", None) is not None:
        config_file.write_text(json.dumps(config, indent=2))


def main(argv=None):
    parser = argparse.ArgumentParser(prog=prog("convert"), description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", type=Path, help="Hugging Face checkpoint directory, or its Hub id")
    source.add_argument(
        "--gguf", type=Path, help="GGUF file, or org/repo/file.gguf on the Hub (config and tokenizer from its metadata)"
    )
    parser.add_argument("--out", required=True, type=Path, help="directory to write (must not exist or be empty)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="expert storage dtype (default: as stored)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (once the new one is done)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--quant",
        choices=[*QUANTIZED, "none"],
        help="store the experts quantized: int8 (a scale per output column) or int4 (a scale per group of 32 k-rows, "
        "llama.cpp's Q4_0 rule; int4-g64 / int4-g128: groups of 64 / 128; mxfp4: e2m1 values with a power of two per "
        "32, GPT-OSS's format), packed for their kernel and memory-mapped "
        "as they are when loaded (int4: 0.28x the bfloat16 experts' bytes); none: floats. Default: floats from a "
        "Hugging Face checkpoint (mxfp4 from an MXFP4 release, code for code), the format closest to a GGUF file's "
        "(Q4_0 -> int4, MXFP4 -> mxfp4 exactly)",
    )
    parser.add_argument(
        "--expert-shards",
        type=int,
        default=1,
        help="write the experts as N stores of 1/N of every layer's (experts.shard-I-of-N/), one per process of an "
        "expert-parallel run (train.py --expert-shards N); default 1: one store",
    )
    args = parser.parse_args(argv)
    if args.gguf is not None and not is_gguf_file(args.gguf):
        raise InputError(f"--gguf {args.gguf}: expected a .gguf file (a checkpoint directory goes with --hf)")
    source = args.hf or args.gguf
    quant = None if args.quant == "none" else (args.quant or GGUF_CLOSEST)
    out = convert(
        source,
        args.out,
        args.dtype,
        progress=not args.no_progress,
        overwrite=args.overwrite,
        quant=quant,
        expert_shards=args.expert_shards,
    )
    print(f"converted {source} -> {out} (expert store checksums verified)")


if __name__ == "__main__":
    sys.exit(run_cli(main))
