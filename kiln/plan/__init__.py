"""The plan: the contract between the builder, which writes it, and the runtime, which reads it.

    spec.py     StepSpec, ProgramSpec, Binding, EnginePlan: plain, JSON-able data
    file.py     the .kiln engine file (versioned header, checksum, safetensors weights)
    memory.py   liveness intervals -> offsets in one arena (the engine's plan and native segments')
"""
