"""rlhf_megatron: a Megatron-Core-backed RL trainer (PPO / GRPO) for large language models.

Importing the package is cheap: it defines the version only. Heavy dependencies (megatron-core,
vLLM, Ray) are imported by the sub-packages that need them.
"""

__version__ = "0.1.0"
