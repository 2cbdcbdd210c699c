"""Helpers shared by tests and benchmarks (each exists once, here): multi-rank runner
(multirank), tiny HF checkpoints (tiny_models), HF references and vLLM settings (hf_reference),
a served vLLM rollout for refit tests (rollout_service), the three-turn episode checks
(episodes), /proc and /dev/shm scans (processes), simulated SLURM (slurm_sim), the (model,
layout) cases (layouts), pytest fixtures (fixtures), CLI training runs and the shared Ray head
(train_runs), the tools quickstart's runs (tools_runs) and the engine tests' token batches
(batches)."""
