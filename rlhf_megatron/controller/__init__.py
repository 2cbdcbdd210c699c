"""Controller: the run (``run``) and its one step loop (``loop``), the sources of its batches and
the phases of a step. The Ray plumbing is in ``rlhf_megatron.cluster``, what a run records in
``rlhf_megatron.records``."""
