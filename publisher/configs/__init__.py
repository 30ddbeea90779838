"""torchao configs as the user gives them: read without eval, described by the tensors they make.

syntax.py   the call syntax (``Int8WeightOnlyConfig(granularity=PerGroup(128))``): an AST reader with an allowlist of
            torchao names, and the reverse (a config object written back as that syntax)
spec.py     what ``--quant`` and ``--layer-config`` take: a recipe name, a call, a ``config_to_dict`` JSON file, a
            per-component mapping; a per-layer table
probe.py    a throw-away layer quantized with torchao's own ``quantize_`` (what a config makes of a weight)
facts.py    hardware and storage facts of a config, from the tensor class it makes and the device rules
layers.py   which entry of an ``FqnToConfig`` a library applies to a parameter (one rule for quantize and verify)

Nothing here imports the stages, verify or the registry (publisher/recipes.py builds on this package).
"""
