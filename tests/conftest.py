"""Fixtures for the whole suite: rlhf_megatron/testing/fixtures.py (e.g. `repo_cwd`), and the
seconds-per-file table (rlhf_megatron/testing/file_durations.py, `--durations-by-file=N`)."""

pytest_plugins = ["rlhf_megatron.testing.fixtures", "rlhf_megatron.testing.file_durations",
                  "pytester"]
