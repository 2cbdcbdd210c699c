"""What a run leaves on disk: its checkpoint directory (``checkpoint_store``), its metrics sinks
(``metrics``) and their plots (``plot``)."""
