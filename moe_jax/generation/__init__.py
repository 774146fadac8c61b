"""Generation: prefill and decode steps, the continuous batch, the generation engine, sampling, the anchor cache."""
