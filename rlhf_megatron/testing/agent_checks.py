"""The agent endpoint checks of the async engine's test (test_async_rollout.py, on its AsyncLLM):
agents written with the real ``openai`` SDK drive episodes through the OpenAI-compatible
endpoint (issue 27). An honest agent (16 concurrent sessions, three turns each): the trained ids
are the generated ones, the rollout log-probs equal an fp32 HF forward, no text mismatch. An agent
that sends its turns back altered: the same ids, every altered turn counted. One agent sends bad
requests and floods its session; one raises; one hangs past the time limit. One session spans a
refit: each generated token records the weight version that sampled it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

AGENT_FILE = '''
import asyncio, json
import aiohttp
import openai

LOG = {}

async def _three_turns(base_url, api_key, sample, alter):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": sample["prompt"]}]
    text = ""
    async with client:
        for turn in range(3):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=12, logprobs=True)
            text = reply.choices[0].message.content
            LOG.setdefault(sample["prompt"], []).append(
                [x.logprob for x in reply.choices[0].logprobs.content])
            sent = "".join(text.split()) + "!" if alter else text
            messages += [{"role": "assistant", "content": sent},
                         {"role": "user", "content": f"result {turn * 17}"}]
    return float(len(text) % 2)

async def honest(base_url, api_key, sample):
    return await _three_turns(base_url, api_key, sample, alter=False)

async def altering(base_url, api_key, sample):
    return await _three_turns(base_url, api_key, sample, alter=True)

async def spanning(base_url, api_key, sample):
    """Two turns with a refit between them (the check's thread refits once LOG says so)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": sample["prompt"]}]
    async with client:
        for turn in range(2):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=12)
            if turn == 0:
                LOG["first_turn_done"] = True
                while not LOG.get("refit_done"):
                    await asyncio.sleep(0.01)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "result 3"}]
    return 1.0

async def choices(base_url, api_key):
    """n=2 with top log-probs, then on with choice 1, streamed."""
    seen = LOG.setdefault("choice_log", {})
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "choose"}]
    async with client:
        reply = await client.chat.completions.create(
            model="policy", messages=messages, n=2, max_tokens=12, logprobs=True,
            top_logprobs=3)
        seen["logprobs"] = [[(x.logprob, [t.logprob for t in x.top_logprobs])
                             for x in c.logprobs.content] for c in reply.choices]
        messages += [reply.choices[1].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "result 1"}]
        stream = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=12, stream=True)
        seen["pieces"] = [c.choices[0].delta.content async for c in stream
                          if c.choices and c.choices[0].delta.content]
    return 1.0

async def too_long(base_url, api_key):
    """A first request whose prompt is past the engine's max_model_len: refused by vLLM."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    async with client:
        try:
            await client.chat.completions.create(model="policy", max_tokens=4, messages=[
                {"role": "user", "content": " ".join(["hello world"] * 300)}])
        except openai.BadRequestError as exc:
            LOG.setdefault("choice_log", {})["too_long"] = (exc.status_code, exc.body)
    return 1.0

async def bad_requests(base_url, api_key, sample):
    if sample["prompt"] == "crash":
        raise RuntimeError("the agent's own bug")
    if sample["prompt"] == "hang":
        await asyncio.sleep(3600)
    if sample["prompt"] == "choices":
        return await choices(base_url, api_key)
    if sample["prompt"] == "too_long":
        return await too_long(base_url, api_key)
    url = base_url + "/chat/completions"
    good = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    auth = {"Authorization": "Bearer " + api_key}
    seen = LOG.setdefault("statuses", {})
    async with aiohttp.ClientSession() as http:
        async def post(name, target, body, headers=auth):
            kwargs = {"data": body} if isinstance(body, str) else {"json": body}
            async with http.post(target, headers=headers, **kwargs) as r:
                seen[name] = (r.status, await r.json())
        await post("wrong_key", url, good, {"Authorization": "Bearer nope"})
        await post("unknown_session", url.replace("/sessions/", "/sessions/x"), good)
        await post("malformed", url, "{not json")
        await post("no_messages", url, {"model": "policy"})
        await post("n17", url, {**good, "n": 17})
        await post("temperature", url, {**good, "temperature": 0.3})
        async with http.post(url, headers=auth, json={**good, "stream": True}) as r:
            seen["stream"] = (r.status, (await r.text()).splitlines())
    chunks = [json.loads(line[6:]) for line in seen["stream"][1]
              if line.startswith("data: {")]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": streamed},
                {"role": "user", "content": "again"}]
    async with client:
        for flood in range(50):
            try:
                reply = await client.chat.completions.create(
                    model="policy", messages=messages, max_tokens=4)
            except openai.BadRequestError as exc:
                seen["flood"] = (flood, exc.status_code, exc.body)
                break
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "again"}]
    return 1.0
'''


def agent_endpoint_checks(engine: Any, hf_dir: str, work_dir: str, weights: dict) -> dict:
    """On a running AsyncRolloutEngine whose weights are ``weights`` (HF names): the facts
    checked by ``assert_agent_endpoint``."""
    import transformers

    from rlhf_megatron.environments.config import AgentConfig, EnvironmentConfig
    from rlhf_megatron.environments.loader import load_agent
    from rlhf_megatron.rollout import SamplingSettings
    from rlhf_megatron.rollout.agent_episodes import AgentRunner
    from rlhf_megatron.rollout.async_episodes import engine_turns
    from rlhf_megatron.rollout.episodes import NO_OPTIONS, ChatFormat
    from rlhf_megatron.testing.episodes import checked_against_hf

    agent_file = Path(work_dir) / "agents.py"
    agent_file.write_text(AGENT_FILE)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    sampling = SamplingSettings(temperature=1.0, max_tokens=12, seed=5)
    generate = engine_turns(engine, sampling)
    out: dict = {}
    for name, count, timeout in (("honest", 16, 120.0), ("altering", 4, 120.0),
                                 ("bad_requests", 3, 8.0)):
        spec = f"{agent_file}:{name}"
        cfg = EnvironmentConfig(agent=AgentConfig(path=spec, timeout_seconds=timeout),
                                max_turns=4, max_tokens_per_turn=12, max_tokens_per_episode=120)
        turns: list[tuple[int, list[int]]] = []
        first_turns: dict[tuple[int, int], list[int]] = {}  # (episode, choice) -> ids

        async def recording(e, max_tokens, options=NO_OPTIONS, turns=turns, ids=first_turns):
            result = await generate(e, max_tokens, options)
            if options.choice == 0:
                turns.append((e.sample_index, list(result.token_ids)))
            if e.turns == 0:
                ids[(e.sample_index, options.choice)] = list(result.token_ids)
            return result

        agent = load_agent(spec)
        runner = AgentRunner(agent, cfg, ChatFormat(tok), recording, sampling)
        prompts = ([f"question {i}" for i in range(count)] if name != "bad_requests"
                   else ["crash", "hang", "bad", "choices", "too_long"])
        episodes = engine.run_coroutine(runner.run_async([{"prompt": p} for p in prompts]))
        log = agent.__globals__["LOG"]
        out[name] = {**checked_against_hf(episodes, turns, tok, hf_dir, weights),
                     "agent_metrics": runner.metrics(episodes), "rewards":
                     [e.reward for e in episodes],
                     "returned_logprobs": [sum(log.get(p, []), []) for p in prompts],
                     "kept_logprobs": [[lp for lp, m in zip(e.logprobs, e.loss_mask) if m]
                                       for e in episodes],
                     "kept_ids": [[i for i, m in zip(e.ids, e.loss_mask) if m] for e in episodes],
                     "statuses": dict(log.get("statuses", {})),
                     "choices": {**log.get("choice_log", {}), "ids": {
                         choice: ids for (episode, choice), ids in first_turns.items()
                         if prompts[episode] == "choices"}}}
    out["spanning"] = _spanning_a_refit(engine, tok, agent_file, sampling, weights)
    return out


def _spanning_a_refit(engine: Any, tok: Any, agent_file: Path, sampling: Any,
                      weights: dict) -> dict:
    """One session whose agent waits after its first turn while this thread refits the engine
    (the same weights, the next version): the weight version of each generated token."""
    from rlhf_megatron.environments.config import AgentConfig, EnvironmentConfig
    from rlhf_megatron.environments.loader import load_agent
    from rlhf_megatron.rollout.agent_episodes import AgentRunner
    from rlhf_megatron.rollout.async_episodes import engine_turns
    from rlhf_megatron.rollout.episodes import ChatFormat
    from rlhf_megatron.testing.hf_reference import layer_buckets

    spec = f"{agent_file}:spanning"
    agent = load_agent(spec)
    log = agent.__globals__["LOG"]
    before = engine.weight_version

    def refit() -> None:
        deadline = time.monotonic() + 60
        while not log.get("first_turn_done") and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.begin_weight_update()
        for bucket in layer_buckets(weights):
            engine.load_weights(bucket)
        engine.finish_weight_update(before + 1)
        log["refit_done"] = True

    thread = threading.Thread(target=refit, daemon=True)
    thread.start()
    cfg = EnvironmentConfig(agent=AgentConfig(path=spec, timeout_seconds=60), max_turns=4,
                            max_tokens_per_turn=12, max_tokens_per_episode=120)
    runner = AgentRunner(agent, cfg, ChatFormat(tok), engine_turns(engine, sampling), sampling)
    (e,) = engine.run_coroutine(runner.run_async([{"prompt": "question 0"}]))
    thread.join(timeout=60)
    versions = e.versions + [-1] * (len(e.ids) - len(e.versions))
    spans, current = [], []
    for mask, version in zip(e.loss_mask, versions, strict=True):
        if mask:
            current.append(version)
        elif current:
            spans, current = spans + [current], []
    return {"before": before, "turn_versions": spans + ([current] if current else []),
            "unsampled_versions": {v for m, v in zip(e.loss_mask, versions, strict=True)
                                   if not m}, "reward": e.reward}


def assert_agent_endpoint(out: dict) -> None:
    """What agent_endpoint_checks must show (see the module docstring)."""
    honest, altering, bad = out["honest"], out["altering"], out["bad_requests"]
    for run in (honest, altering):
        assert run["turns"] == [3] * len(run["turns"]) and not any(run["truncated"]), run
        assert run["kept_equals_generated"], run
        assert run["lp_diff"] < 1e-4, run
        assert run["returned_logprobs"] == run["kept_logprobs"], run
        assert run["agent_metrics"]["agent/failed_frac"] == 0.0, run
    assert honest["agent_metrics"]["agent/sessions"] == 16
    assert honest["agent_metrics"]["agent/text_mismatches"] == 0, honest["agent_metrics"]
    # Re-tokenising the decoded turns drifts with this BPE: counted, never used for training.
    assert honest["agent_metrics"]["agent/token_mismatches"] >= 1, honest["agent_metrics"]
    assert altering["agent_metrics"]["agent/text_mismatches"] == 4 * 2, altering["agent_metrics"]
    m = bad["agent_metrics"]
    assert m["agent/failed_frac"] == 2 / 5 and bad["rewards"][:2] == [0.0, 0.0], bad
    assert bad["rewards"][2:] == [1.0, 1.0, 1.0] and bad["truncated"][4], bad
    # The session went on with choice 1 of its n=2 request: those ids and log-probs are what
    # the episode keeps (the log-probs equal HF's over all these episodes, within 1e-4).
    assert bad["lp_diff"] < 1e-4 and m["agent/choices_taken"] == 1, bad
    picked = bad["choices"]
    first, second = picked["ids"][0], picked["ids"][1]
    assert first != second, picked  # each choice its own seed
    assert bad["kept_ids"][3][:len(second)] == second, (bad["kept_ids"][3], second)
    for lps in picked["logprobs"]:  # vLLM's top 3, most likely first, the sampled one below
        for lp, top in lps:
            assert len(top) == 3 and top == sorted(top, reverse=True) and lp <= top[0] + 1e-6
    assert len(picked["pieces"]) >= 2, picked["pieces"]  # streamed in pieces
    status, body = picked["too_long"]
    message = body.get("message") or body["error"]["message"]
    assert status == 400 and "\n" not in message, body
    assert "maximum context length is 256" in message, body
    statuses = bad["statuses"]
    expected = {"wrong_key": 401, "unknown_session": 404, "malformed": 400, "no_messages": 400,
                "n17": 400, "temperature": 400}
    for name, status in expected.items():
        got, body = statuses[name]
        assert got == status, (name, statuses[name])
        assert "\n" not in body["error"]["message"] and body["error"]["code"] == status, body
    status, lines = statuses["stream"]
    assert status == 200 and "data: [DONE]" in lines, lines
    flood_turn, flood_status, flood_body = statuses["flood"]
    message = flood_body.get("message") or flood_body["error"]["message"]
    assert flood_status == 400 and "limit" in message, statuses["flood"]
    assert m["agent/http_errors"] >= 7, m  # the six refusals and the flood's end
    # A session across a refit: its first turn's tokens carry the old version, its second the new.
    span = out["spanning"]
    v = span["before"]
    assert [set(t) for t in span["turn_versions"]] == [{v}, {v + 1}], span
    assert span["unsampled_versions"] == {-1} and span["reward"] == 1.0, span
