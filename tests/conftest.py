"""Fixtures for the whole suite: rlhf_megatron/testing/fixtures.py (e.g. `repo_cwd`)."""

pytest_plugins = ["rlhf_megatron.testing.fixtures"]
