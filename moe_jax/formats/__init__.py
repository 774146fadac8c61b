"""Files on disk: Hugging Face checkpoints (config.json, safetensors, block-scaled FP8), converted directories, GGUF
files, tokenizers and chat templates, PEFT adapters, prompt and data files. Hugging Face's tensor naming lives here."""
