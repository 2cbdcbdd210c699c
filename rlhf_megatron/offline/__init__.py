"""Offline trainers on the Megatron engines: SFT, DPO and KTO (`algorithm.name: sft | dpo | kto`).

No rollout engines: the controller (offline/trainer.py) reads a dataset (offline/datasets.py),
builds only the actor worker group, and drives one optimizer step per batch through the actor
engine's own forward/backward with the losses of offline/losses.py (offline/steps.py).
Layouts, checkpoints, resume and `rlhf-convert mcore-to-hf` export are the RL path's.

This module stays import-light: config/schema.py imports offline.config.
"""

from rlhf_megatron.offline.config import OFFLINE_ALGORITHMS, OfflineSettings

__all__ = ["OFFLINE_ALGORITHMS", "OfflineSettings"]
