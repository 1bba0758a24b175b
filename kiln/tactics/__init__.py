"""Tactics: the kernels a layer may run on a device. tactic.py is the interface (Tactic, InputMeta,
NativeStep), registry.py the catalog, cpu/ and cuda/ the candidates of each device, loaded only for
that device. Choosing among them is the builder's job (kiln/builder/autotune.py)."""
