"""Deciding where things run: the execution plan made at load, the probe's measurements, the cost model and its
simulation, the expert-cache policy, auto's choice, the memory check and the advisor."""
