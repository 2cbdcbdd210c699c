"""`python -m rlhf_megatron ...` is the `rlhf-megatron` command."""

import sys

from rlhf_megatron.cli import main

sys.exit(main())
