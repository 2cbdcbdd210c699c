"""rlhf_megatron: a Megatron-Core-backed RL trainer (PPO / GRPO) for large language models.

Importing the package is cheap: it defines the version and defers Megatron-Core's torch.compile
decorations to their first call (lazy_compile.py: a finder for the first import of megatron.core,
~0.75 s less in every process that imports it). Heavy dependencies (megatron-core, vLLM, Ray)
are imported by the sub-packages that need them.
"""

from rlhf_megatron import lazy_compile

__version__ = "0.1.0"

lazy_compile.install()
