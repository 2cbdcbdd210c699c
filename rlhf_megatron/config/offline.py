"""Settings of the offline trainers (the `algorithm.offline` section). No project imports here:
config/schema.py imports this module."""

from __future__ import annotations

from dataclasses import dataclass

OFFLINE_ALGORITHMS = ("sft", "dpo", "kto")


@dataclass
class OfflineSettings:
    """SFT / DPO / KTO settings; `data.prompts_per_step` is the number of examples per step
    (conversations for SFT, pairs for DPO, examples for KTO)."""

    beta: float = 0.1
    """DPO/KTO: strength of the implicit KL regulariser; the implicit reward of a completion is
    beta * (log pi(y|x) - log pi_ref(y|x)). For IPO, tau = beta (target margin 1 / (2 beta))."""
    dpo_loss: str = "sigmoid"
    """'sigmoid' (Rafailov et al. 2023) or 'ipo' (Azar et al. 2023)."""
    kto_lambda_d: float = 1.0
    """KTO weight of desirable examples (lambda_D)."""
    kto_lambda_u: float = 1.0
    """KTO weight of undesirable examples (lambda_U)."""
    max_length: int = 512
    """Longest example in tokens (prompt + completion, or a whole conversation); a longer one is
    an error naming its file and line."""
    messages_key: str = "messages"
    """SFT: field holding the conversation ([{'role', 'content'}, ...]); the loss is on the
    assistant turns only."""
    chosen_key: str = "chosen"
    """DPO: field of the preferred completion (text, or messages ending in an assistant turn)."""
    rejected_key: str = "rejected"
    """DPO: field of the dispreferred completion."""
    completion_key: str = "completion"
    """KTO: field of the completion."""
    label_key: str = "label"
    """KTO: field saying whether the completion is desirable (true) or undesirable (false)."""
