"""The HTTP server behind `python -m moe_jax.serve`: OpenAI's and Anthropic's APIs over one continuously batched
generation engine (see docs/ARCHITECTURE.md for its files)."""
