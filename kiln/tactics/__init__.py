"""Tactics: the kernels a layer may run, how one is chosen at build (autotune.py) and remembered
(timing_cache.py). tactic.py is the interface, registry.py the catalog, cpu.py the CPU tactics."""
