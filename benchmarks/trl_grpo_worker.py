"""TRL's GRPOTrainer on the quickstart model and task; run by grpo_bench.py inside TRL's own venv.

    python trl_grpo_worker.py SETTINGS_JSON OUT_JSON

Prints nothing useful; writes per-step wall-clock seconds, the time spent in TRL's
`_generate_and_score_completions` (generation, reference log-probs, rewards) and the token count
of each step's batch to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    settings = json.loads(open(sys.argv[1]).read())
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(settings["threads"])
    rows = [json.loads(line) for line in open(settings["train_file"])]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(settings["model"])

    def exact_match(prompts, completions, answer, **kwargs):
        return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]

    rollout_rows = settings["prompts_per_step"] * settings["n"]
    config = GRPOConfig(
        output_dir=settings["out_dir"], use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=rollout_rows, gradient_accumulation_steps=1,
        num_generations=settings["n"], max_completion_length=settings["max_tokens"],
        temperature=1.0, learning_rate=settings["lr"], beta=settings["kl_coef"],
        num_iterations=1, max_steps=settings["steps"], logging_steps=1, report_to="none",
        save_strategy="no", seed=settings["seed"], dataloader_num_workers=0,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
    )
    trainer = GRPOTrainer(model=settings["model"], reward_funcs=exact_match, args=config,
                          train_dataset=dataset, processing_class=tokenizer)
    steps: list[dict] = []
    current: dict = {}
    original = trainer._generate_and_score_completions

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        out = original(*args, **kwargs)
        current["rollout_and_logprobs"] = current.get("rollout_and_logprobs", 0.0) + \
            time.perf_counter() - start
        mask = out.get("completion_mask")
        prompt_mask = out.get("prompt_mask")
        tokens = 0.0
        for m in (mask, prompt_mask):
            if m is not None:
                tokens += float(m.sum())
        current["tokens"] = current.get("tokens", 0.0) + tokens
        current["sequences"] = current.get("sequences", 0) + int(prompt_mask.shape[0])
        return out

    trainer._generate_and_score_completions = timed_generate

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current.clear()
            current["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - current.pop("start")
            steps.append({"seconds": seconds, **current})

    trainer.add_callback(StepTimer())
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    with open(sys.argv[2], "w") as out:
        json.dump({"steps": steps, "rewards": rewards,
                   "versions": {"trl": __import__("trl").__version__,
                                "torch": torch.__version__}}, out)


if __name__ == "__main__":
    main()
