"""The expert cache policy: capacity from the byte budget, hottest experts kept, churn bounded."""

import numpy as np
import pytest

from moe_jax.errors import InputError
from moe_jax.planning.expert_cache import ExpertCache

EXPERT_BYTES = 1000


def cache(budget_experts_per_layer=2, layers=(0, 1), experts=8, **kwargs):
    return ExpertCache(
        list(layers), experts, EXPERT_BYTES, budget_experts_per_layer * EXPERT_BYTES * len(layers), **kwargs
    )


def test_capacity_is_the_budget_split_evenly_over_layers():
    c = cache(budget_experts_per_layer=3)
    assert c.capacity == 3 and c.bytes_when_full == 3 * EXPERT_BYTES * 2
    c.set_budget(5 * EXPERT_BYTES - 1)  # 2.4999 experts per layer
    assert c.capacity == 2 and c.bytes_when_full <= 5 * EXPERT_BYTES
    c.set_budget(10**9)
    assert c.capacity == 8  # never more than the layer has
    with pytest.raises(InputError, match="budget"):
        c.set_budget(-1)
    with pytest.raises(InputError, match="decay"):
        cache(decay=1.0)


def test_free_slots_fill_with_the_hottest_routed_experts():
    c = cache(budget_experts_per_layer=3)
    c.observe({0: np.array([0, 5, 0, 9, 1, 0, 0, 0])})
    assert c.target(0) == [3, 1, 4]
    assert c.choose(0, []) == [3, 1, 4]
    assert c.choose(1, []) == []  # nothing routed in layer 1 yet: nothing worth a copy


def test_churn_is_bounded_and_similar_heat_does_not_swap():
    c = cache(budget_experts_per_layer=3, max_swaps=1, margin=1.25)
    current = [0, 1, 2]
    c.observe({0: np.array([10, 10, 10, 50, 60, 70, 11, 0])})
    after = c.choose(0, current)
    assert len(set(after) - set(current)) == 1 and after.count(5) == 1  # one swap, the hottest comes first
    for _ in range(5):
        after = c.choose(0, after)
    assert sorted(after) == [3, 4, 5]  # converges to the target, one swap per update
    assert c.choose(0, [3, 4, 6]) == [3, 4, 5]  # 6 (heat 11) loses to 5 (heat 70)
    c2 = cache(budget_experts_per_layer=1, margin=1.25)
    c2.observe({0: np.array([10, 12, 0, 0, 0, 0, 0, 0])})
    assert c2.choose(0, [0]) == [0]  # 12 is not 1.25 x 10: no copy for a near tie


def test_heat_decays_so_the_cache_follows_a_shifting_workload():
    c = cache(budget_experts_per_layer=1, decay=0.5, max_swaps=1)
    c.observe({0: np.array([100, 0, 0, 0, 0, 0, 0, 0])})
    cached = c.choose(0, [])
    assert cached == [0]
    for _ in range(6):
        c.observe({0: np.array([0, 0, 0, 0, 0, 0, 0, 20])})
        cached = c.choose(0, cached)
    assert cached == [7]
