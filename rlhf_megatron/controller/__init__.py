"""Controller: the PPO/GRPO loop, its metrics sinks (``controller.metrics``), metric plots
(``controller.plot``) and the run's checkpoint directory (``controller.checkpoint_store``)."""
