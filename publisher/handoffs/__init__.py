"""The typed hand-offs between the pipeline's stages, below both stages/ and verify/ so imports run one way.

plan.py       Source (the base, pinned) and Plan (the job, validated) with its Components
artifacts.py  Artifacts: what quantization made (QuantizedComponent, LayerReport), the unfinished-folder marker
report.py     VerifyReport and what every reload must reproduce (Expected, PassForward, ...)
state.py      the state file's name
"""
