"""A model's compiled generation: the jitted prefill/decode steps of its last few structures (a memory split moved
back and forth does not recompile each time), and the engines kept for reuse (an evaluation loop does not recompile
each time)."""

from __future__ import annotations

import jax

from moe_jax.generation.engine import TOKEN_BUCKET, GenerationEngine, compile_generation_steps, round_up

KEPT_STRUCTURES = 4


class CompiledGeneration:
    def __init__(self, model):
        self.model = model
        self._steps = []  # [(graphdef, generation steps)], most recent first
        self._engines = {}  # (slots, bucketed max_len) -> engine, for the current structure

    def structure_changed(self):
        self._engines = {}  # their steps were compiled for the old structure

    def steps(self):
        """The jitted GenerationSteps for the model's current structure, after the plan's decode packing."""
        model = self.model
        model.pack_for_decode()
        for graphdef, steps in self._steps:
            if graphdef == model.graphdef:
                return steps
        steps = compile_generation_steps(model.graphdef, jax.tree.structure(model.state), model.plan.argmax)
        self._steps = [(model.graphdef, steps), *self._steps[: KEPT_STRUCTURES - 1]]
        return steps

    def engine(self, slots: int, max_len: int, anchor_cache=None) -> GenerationEngine:
        """An engine with fresh stats; engines without an anchor cache are kept and reused, with their steps."""
        if anchor_cache is not None:
            return GenerationEngine(self.model, slots, max_len, anchor_cache)
        key = (slots, round_up(max_len, TOKEN_BUCKET))
        if key not in self._engines:
            self._engines[key] = GenerationEngine(self.model, *key)
        engine = self._engines[key]
        engine.stats = type(engine.stats)()
        return engine
