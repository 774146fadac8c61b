"""The bundled default: a tiny Mixtral-style model pretrained on string tasks (copy, sort) and the data that
fine-tunes it on another (reverse), inside the package so that `moe-jax train` / `infer` / `serve` work from an
installed wheel. A checkout links models/tiny-moe and data/ here. Remade by scripts/make_default_model.py."""

from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = HERE / "tiny-moe"
DATA = HERE / "data"
TRAIN_DATA = DATA / "reverse_train.jsonl"
EVAL_DATA = DATA / "reverse_eval.jsonl"
PROMPTS = DATA / "default_prompts.jsonl"
