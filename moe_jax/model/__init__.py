"""The model as math: its config, the Flax NNX transformer (attention, latent attention, norms, router, expert
blocks), rotary frequencies and LoRA. Nothing here knows where experts run: each MoE block calls the expert module
its placement built (moe_jax/backends/)."""
