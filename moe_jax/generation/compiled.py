"""A model's compiled generation: the jitted prefill/decode steps of its last few structures (a memory split moved
back and forth does not recompile each time; engines, made fresh for each use, share them)."""

from __future__ import annotations

import weakref

import jax

from moe_jax.generation.drafting import SharedDrafts
from moe_jax.generation.engine import GenerationEngine, compile_generation_steps
from moe_jax.generation.speculation import DraftPolicy

KEPT_STRUCTURES = 4


class CompiledGeneration:
    def __init__(self, model):
        # the model holds this; a reference back would make a cycle, and a model dropped in one stayed in memory:
        # the cycle collector left its host experts, which JAX's caches of the compiled steps reach (plain
        # reference counting frees them)
        self._model = weakref.ref(model)
        self._steps = []  # [(graphdef, generation steps)], most recent first
        self._draft_policies: dict[tuple[int, str, bool], DraftPolicy] = {}
        self.shared_drafts = SharedDrafts()  # earlier outputs new sequences draft from, by scope
        # process 0 of a generation over expert shards: its steps run on every process (generation/lockstep.py)
        self.leader = None

    @property
    def model(self):
        return self._model()

    def steps(self):
        """The jitted GenerationSteps for the model's current structure (packed for decode or not: the engine
        packs before its first batch, `Model.pack_for_decode`)."""
        model = self.model
        steps = next((kept for graphdef, kept in self._steps if graphdef == model.graphdef), None)
        if steps is None:
            steps = compile_generation_steps(model.graphdef, jax.tree.structure(model.state), model.plan.argmax)
            self._steps = [(model.graphdef, steps), *self._steps[: KEPT_STRUCTURES - 1]]
        return steps if self.leader is None else self.leader.steps(steps)

    def new_caches(self, slots: int, length: int):
        """Zeroed KV caches for `slots` sequences of `length` tokens (KVCacheMemory.new_caches; on every process
        of a generation over expert shards)."""
        if self.leader is not None:
            return self.leader.new_caches(slots, length)
        return self.model.kv.new_caches(slots, length)

    def draft_policy(self, drafts: int, policy: str, sampled: bool = False) -> DraftPolicy:
        """The model's speculative-decoding policy for these settings, kept from engine to engine: what it has
        measured of this model's steps on this machine, and of its workload's acceptance, stays learned. `sampled`:
        the one for batches with sampled jobs (their speculative steps are the host's, one at a time)."""
        key = (drafts, policy, sampled)
        if key not in self._draft_policies:
            self._draft_policies[key] = DraftPolicy(drafts, policy)
        return self._draft_policies[key]

    def engine(self, slots: int, max_len: int, anchor_cache=None, drafts: int = 0) -> GenerationEngine:
        """A new engine (fresh stats) over the model's compiled steps (`drafts`: see GenerationEngine)."""
        return GenerationEngine(self.model, slots, max_len, anchor_cache, drafts=drafts)
