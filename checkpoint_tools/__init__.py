"""Offline checkpoint conversion: `python -m checkpoint_tools hf-to-mcore | mcore-to-hf | verify |
inspect` (console script `rlhf-convert`). All layouts come from the architecture's mapping table
in `rlhf_megatron.models`; this package only moves files."""
