"""The OpenAI-compatible agent proxy against a real embedded generation server on loopback: agents
written with the `openai` package only (loaded from a file, as `rollout.workflow=path:Name` does),
their sessions exported as trajectories whose tokens, logprobs and versions are exactly the server's;
auth and request errors; the built-in `OpenAIToolAgent` with a stub tool set."""

import asyncio
import textwrap

import aiohttp
import numpy as np
import msgspec
import openai
import pytest

from _agent_server import agent_model_dir, server  # noqa: F401 (fixtures)

from areal_like.agent import AgentProxy, OpenAIToolAgent, run_agent_group
from areal_like.api.config import GenerationConfig, MultiTurnConfig
from areal_like.api.workflow import EpisodeContext, load_user_workflow
from areal_like.data.dataset import PromptRecord
from areal_like.engine.client import GenerationClient, GenerationResult

pytestmark = pytest.mark.integration

# The user's agents: plain code against the `openai` SDK (+ aiohttp for /rl/set_reward); nothing from
# areal_like. The random tiny model rarely calls tools, so ChatAgent feeds a tool result back itself.
AGENT_SOURCE = textwrap.dedent('''
    import aiohttp
    import openai

    TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a key up",
              "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}]


    class ChatAgent:
        """Two chat turns with a tool result between them; the reward is set through /rl/set_reward."""

        async def run(self, data, *, base_url, api_key, model, max_turns, **kwargs):
            client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
            messages = [{"role": "user", "content": data["prompt"]}]
            try:
                for turn in range(min(2, max_turns)):
                    r = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                             max_tokens=10)
                    msg = r.choices[0].message
                    entry = {"role": "assistant", "content": msg.content or ""}
                    calls = msg.tool_calls or []
                    if calls:
                        entry["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                            "name": c.function.name, "arguments": c.function.arguments}} for c in calls]
                    messages.append(entry)
                    messages.append({"role": "tool", "tool_call_id": calls[0].id if calls else "call_x",
                                     "content": "42"})
            finally:
                await client.close()
            root = base_url[:-len("/v1")]
            async with aiohttp.ClientSession() as s:
                async with s.post(root + "/rl/set_reward", json={"reward": 1.0},
                                  headers={"Authorization": "Bearer " + api_key}) as resp:
                    assert resp.status == 200, await resp.text()
            return None


    class TokenAgent:
        """Token-in/token-out through /v1/completions: turn 2's prompt extends turn 1's exactly."""

        async def run(self, data, *, base_url, api_key, model, **kwargs):
            client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
            try:
                r1 = await client.completions.create(model=model, prompt=data["prompt"], max_tokens=6,
                                                     extra_body={"return_token_ids": True})
                prompt = r1.model_extra["prompt_token_ids"]
                out = r1.choices[0].model_extra["token_ids"]
                r2 = await client.completions.create(model=model, prompt=prompt + out + prompt[:1] * 3, max_tokens=6,
                                                     extra_body={"return_token_ids": True})
                assert r2.usage.prompt_tokens == len(prompt) + len(out) + 3
            finally:
                await client.close()
            return 0.5


    class LoopAgent:
        """Ignores max_turns and keeps asking for completions (issue 24: 301 completions with
        max_assistant_turns 2) until the proxy refuses one; at most 40 tries so it ends either way."""

        refusals = []

        async def run(self, data, *, base_url, api_key, model, **kwargs):
            client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
            try:
                for _ in range(40):
                    try:
                        await client.completions.create(model=model, prompt=data["prompt"], max_tokens=3)
                    except openai.BadRequestError as e:
                        type(self).refusals.append(e.body)
                        break
            finally:
                await client.close()
            return 1.0
''')

GEN = GenerationConfig(n=2, max_new_tokens=10, temperature=1.0)
MT = MultiTurnConfig(max_assistant_turns=3)


@pytest.fixture(scope="module")
def tok(agent_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(agent_model_dir)


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    path = tmp_path_factory.mktemp("user_agents") / "my_agents.py"
    path.write_text(AGENT_SOURCE)
    assert "areal_like" not in AGENT_SOURCE
    return {name: load_user_workflow(f"{path}:{name}") for name in ("ChatAgent", "TokenAgent", "LoopAgent")}


class RecordingClient(GenerationClient):
    """The real client; remembers each request and exactly what the server returned (by rid)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: dict[str, tuple[list[int], dict, GenerationResult]] = {}

    async def generate(self, input_ids, **kw):
        res = await super().generate(input_ids, **kw)
        self.calls[kw["rid"]] = (list(input_ids), dict(kw), res)
        return res


class KeepSessions(AgentProxy):
    """Keeps every session it opened (the runner closes them) so the test can look at the records."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.opened = []

    def open_session(self, group_id, index):
        s = super().open_session(group_id, index)
        self.opened.append(s)
        return s


class StubReward:
    def __init__(self):
        self.texts = []

    async def score(self, data_source, text, ground_truth, extra_info=None, *, question="", key=None):
        self.texts.append(text)
        return 0.25


def record(prompt="hi", **extra_info):
    return PromptRecord(prompt_id="p0", input_ids=[5, 6], ground_truth="", data_source="test", extra_info=extra_info,
                        raw_prompt=prompt, row={"prompt": prompt, "extra_info": extra_info})


def context(client, tok, group_id, *, tools=None, row=None, gen=GEN):
    return EpisodeContext(client=client, tokenizer=tok, reward=StubReward(), gen=gen, multi_turn=MT,
                          row=row or record(), group_id=group_id, tools=tools, seed=7, max_context_len=512)


async def post(url, body, key, path="/chat/completions"):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as r:
            return r.status, await r.json(content_type=None), r.headers


def check_trajectory_against_server(traj, completions, calls, group_id, index):
    """Tokens/logprobs/versions of the trajectory = exactly what the server returned for each completion."""
    assert completions
    for c in completions:  # every record is the server's reply, untouched
        input_ids, _, res = calls[f"{group_id}-{index}-c{c.seq}"]
        assert c.prompt_ids == input_ids and c.output_ids == res.output_ids
        assert c.output_logprobs == res.output_logprobs and c.output_versions == res.output_versions
    ids, mask = traj.ids_np().tolist(), traj.mask_np()
    lps, vers = traj.logprobs_np(), traj.versions_np()
    gen = mask == 1
    assert ids[:traj.prompt_len] == completions[0].prompt_ids
    assert np.array_equal(np.asarray(ids)[gen], [t for c in completions for t in c.output_ids])
    assert np.array_equal(lps[gen], np.asarray([x for c in completions for x in c.output_logprobs], np.float32))
    assert vers[gen].tolist() == [v for c in completions for v in c.output_versions]
    assert (vers[~gen] == -1).all() and (lps[~gen] == 0).all()  # prompt, tool results, template glue
    assert traj.mask_np()[:traj.prompt_len].sum() == 0


async def test_chat_agent_group_records_exactly_the_server(server, tok, agents):
    assert agents["ChatAgent"].kind == "agent"
    async with RecordingClient([server.url], health_interval_s=None) as client:
        async with KeepSessions(client, tok, GEN, MT, seed=7) as proxy:
            ctx = context(client, tok, "grpA")
            trajs = await run_agent_group(ctx, agents["ChatAgent"].obj, proxy)
            assert proxy._sessions == {}  # every session closed
    assert trajs and len(proxy.opened) == 2 and ctx.info["agent_completions"] == 4
    for s in proxy.opened:
        comps = s.completions
        assert len(comps) == 2 and comps[-1].reward == 1.0 and comps[0].reward is None
        mine = [t for t in trajs if t.traj_id.startswith(f"grpA-{s.index}")]
        if len(mine) == 1:  # the template re-rendered turn 1 into the same tokens: one concat trajectory
            (t,) = mine
            assert t.traj_id == f"grpA-{s.index}" and t.reward == 1.0
            assert comps[1].prompt_ids[:len(comps[0].prompt_ids) + len(comps[0].output_ids)] == \
                comps[0].prompt_ids + comps[0].output_ids
            check_trajectory_against_server(t, comps, client.calls, "grpA", s.index)
        else:  # e.g. the model wrote a special token that the text round trip drops
            assert [t.traj_id for t in mine] == [f"grpA-{s.index}-c0", f"grpA-{s.index}-c1"]
            assert [t.reward for t in mine] == [1.0, 1.0]
            for t, c in zip(mine, comps):
                check_trajectory_against_server(t, [c], client.calls, "grpA", s.index)
        # sampling = the run's settings, the seed stable per (group, sample, completion)
        (_, kw, _), (_, kw1, _) = client.calls[f"grpA-{s.index}-c0"], client.calls[f"grpA-{s.index}-c1"]
        assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["key"]) == (1.0, 1.0, -1, "grpA")
        assert kw["sampling_seed"] == ctx.sampling_seed(s.index, 0) and kw1["sampling_seed"] == ctx.sampling_seed(
            s.index, 1)
        assert kw["max_new_tokens"] == 10 and tok.eos_token_id in kw["stop_token_ids"]
    # the server gives the same tokens (and logprobs) again for the same request
    input_ids, kw, res = client.calls["grpA-0-c1"]
    async with GenerationClient([server.url], health_interval_s=None) as c2:
        again = await c2.generate(input_ids, **{**kw, "rid": "replay"})
    assert again.output_ids == res.output_ids
    assert again.output_logprobs == pytest.approx(res.output_logprobs, abs=1e-5)


async def test_completions_agent_concat_and_float_reward(server, tok, agents):
    async with RecordingClient([server.url], health_interval_s=None) as client:
        async with KeepSessions(client, tok, GEN, MT, seed=7) as proxy:
            trajs = await run_agent_group(context(client, tok, "grpB"), agents["TokenAgent"].obj, proxy,
                                          turn_discount=0.5)
    assert sorted(t.traj_id for t in trajs) == ["grpB-0", "grpB-1"]  # token prefix by construction: concat
    for t in trajs:
        s = next(s for s in proxy.opened if t.traj_id == f"grpB-{s.index}")
        check_trajectory_against_server(t, s.completions, client.calls, "grpB", s.index)
        c0, c1 = s.completions
        n0 = len(c0.prompt_ids) + len(c0.output_ids)
        assert t.mask_np()[n0:n0 + 3].tolist() == [0, 0, 0]  # the agent's 3 observation tokens
        assert t.reward == 0.5 and t.num_tokens == len(c1.prompt_ids) + len(c1.output_ids)
    # individual export of the same session: the float reward discounted backwards
    s = proxy.opened[0]
    ind = proxy.session_trajectories(s, group_id="grpB", prompt_id="p0", index=s.index, reward=0.5,
                                     export_style="individual", turn_discount=0.5)
    assert [t.reward for t in ind] == [0.25, 0.5]


async def test_errors_auth_n_context_overrides_and_models(server, tok):
    async with RecordingClient([server.url], health_interval_s=None) as client:
        # more completions than MT's cap (3) on one session: the cap has its own test
        mt = MultiTurnConfig(max_assistant_turns=3, max_completions_per_episode=10)
        async with AgentProxy(client, tok, GEN, mt, seed=1) as proxy:
            s = proxy.open_session("grpC", 0)
            msgs = [{"role": "user", "content": "hi"}]
            root = proxy.base_url[:-3]
            st, body, _ = await post(proxy.base_url, {"messages": msgs}, None)
            assert st == 401 and "Authorization" in body["error"]["message"]
            st, body, _ = await post(proxy.base_url, {"messages": msgs}, "wrong")
            assert st == 401 and "unknown" in body["error"]["message"]
            bad = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="wrong", max_retries=0, timeout=30)
            good = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s.api_key, max_retries=0, timeout=30)
            try:
                with pytest.raises(openai.AuthenticationError):
                    await bad.chat.completions.create(model="m", messages=msgs)
                with pytest.raises(openai.BadRequestError) as e:
                    await good.chat.completions.create(model="m", messages=msgs, n=2)
                assert e.value.body["param"] == "n" and "n must be 1" in e.value.body["message"]
                with pytest.raises(openai.BadRequestError) as e:
                    await good.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 600}])
                assert e.value.body["code"] == "context_length_exceeded"
                assert [m.id for m in (await good.models.list()).data] == ["areal_like"]
                c = await good.completions.create(model="m", prompt="ab", max_tokens=4, logprobs=1)
                assert c.choices[0].finish_reason in ("stop", "length") and c.usage.prompt_tokens == 2
                assert len(c.choices[0].logprobs.token_logprobs) == c.usage.completion_tokens <= 4
                # streaming is emulated: one chunk with the whole reply, then the finish chunk
                stream = await good.chat.completions.create(model="m", messages=msgs, max_tokens=3, stream=True)
                chunks = [ch async for ch in stream]
                assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
            finally:
                await bad.close()
                await good.close()
            # a request asking for other sampling settings is served with the run's and told so
            st, body, headers = await post(proxy.base_url, {"messages": msgs, "temperature": 0.2, "seed": 3,
                                                            "max_tokens": 100}, s.api_key)
            assert st == 200 and body["sampling_overridden"] == ["temperature", "seed"]
            assert headers["X-Areal-Like-Sampling-Overridden"] == "temperature,seed"
            _, kw, res = client.calls[f"grpC-0-c{s.completions[-1].seq}"]
            assert kw["temperature"] == 1.0 and kw["max_new_tokens"] == 10  # min(100, generation.max_new_tokens)
            assert body["usage"]["completion_tokens"] == len(res.output_ids)
            # rewards: by id, last by default, unknown id → 404
            st, body, _ = await post(root, {"reward": 2.0}, s.api_key, "/rl/set_reward")
            assert st == 200 and body["completion_id"] == s.completions[-1].id and s.completions[-1].reward == 2.0
            st, body, _ = await post(root, {"completion_id": s.completions[0].id, "reward": -1}, s.api_key,
                                     "/rl/set_reward")
            assert st == 200 and s.completions[0].reward == -1.0
            st, body, _ = await post(root, {"completion_id": "chatcmpl-nope", "reward": 1}, s.api_key,
                                     "/rl/set_reward")
            assert st == 404 and "chatcmpl-nope" in body["error"]["message"]
            st, body, _ = await post(proxy.base_url, {"messages": msgs, "stop": ["x"]}, s.api_key)
            assert st == 400 and body["error"]["param"] == "stop"
            proxy.close_session(s)
            st, _, _ = await post(proxy.base_url, {"messages": msgs}, s.api_key)
            assert st == 401


@pytest.mark.parametrize("cap", [None, 5])
async def test_looping_agent_is_capped_per_episode(server, tok, agents, cap):
    """Issue 24 item 7: an agent that loops on completions gets a 400 naming
    rollout.multi_turn.max_completions_per_episode past the cap (null = max_assistant_turns); the refused
    request generates nothing, the group has at most cap samples per episode, and refusals are counted."""
    mt = MultiTurnConfig(max_assistant_turns=3, max_completions_per_episode=cap, export_style="individual")
    want = cap or mt.max_assistant_turns
    agent = agents["LoopAgent"].obj
    type(agent).refusals.clear()
    async with RecordingClient([server.url], health_interval_s=None) as client:
        async with KeepSessions(client, tok, GEN, mt, seed=7) as proxy:
            ctx = context(client, tok, "grpL")
            trajs = await run_agent_group(ctx, agent, proxy, export_style="individual")
    assert len(client.calls) == GEN.n * want  # the server generated exactly the admitted completions
    assert [len(s.completions) for s in proxy.opened] == [want] * GEN.n
    assert [s.refused for s in proxy.opened] == [1] * GEN.n and proxy.refused_completions == GEN.n
    assert len(trajs) == GEN.n * want
    for i in range(GEN.n):
        assert len([t for t in trajs if t.traj_id.startswith(f"grpL-{i}-")]) == want
    assert ctx.info["agent_completions"] == GEN.n * want and ctx.info["agent_completions_refused"] == GEN.n
    assert len(type(agent).refusals) == GEN.n
    for body in type(agent).refusals:
        assert body["code"] == "max_completions_per_episode_exceeded"
        assert "rollout.multi_turn.max_completions_per_episode" in body["message"]


async def test_generation_error_is_502(tok):
    async with GenerationClient(["http://127.0.0.1:9"], health_interval_s=None, max_connection_retries=0,
                                down_wait_s=0) as client:
        async with AgentProxy(client, tok, GEN, MT) as proxy:
            s = proxy.open_session("grpD", 0)
            st, body, _ = await post(proxy.base_url, {"messages": [{"role": "user", "content": "hi"}]}, s.api_key)
    assert st == 502 and body["error"]["code"] == "generation_failed" and "127.0.0.1:9" in body["error"]["message"]
    assert s.completions == []


# ---- the built-in agent, with a scripted generation client (the random model never calls tools) ----
class ScriptedClient:
    """Stands in for GenerationClient: answers turn k with the k-th scripted text (+ EOS)."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.calls = tok, list(texts), []

    async def generate(self, input_ids, **kw):
        self.calls.append((list(input_ids), kw))
        k = int(kw["rid"].rsplit("-c", 1)[1])
        if self.texts[k] is None:
            await asyncio.sleep(3600)
        ids = self.tok.encode(self.texts[k], add_special_tokens=False) + [self.tok.eos_token_id]
        return GenerationResult(output_ids=ids, output_logprobs=[-0.5] * len(ids), output_versions=[4] * len(ids),
                                finish_reason="stop", server="scripted")


class StubTools:
    def __init__(self):
        self.calls = []

    def schemas(self):
        return [{"type": "function", "function": {"name": "lookup", "description": "look a key up", "parameters": {
            "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]

    async def call(self, name, arguments, tools_kwargs):
        self.calls.append((name, arguments, tools_kwargs))

        class Result:
            text, error = f"value of {arguments.get('key')}", None

        return Result()


async def _run_builtin_agent(tok, texts, group_id, mt=MT):
    """The built-in OpenAIToolAgent on "find x" through the proxy, the model's turns scripted."""
    client, tools = ScriptedClient(tok, texts), StubTools()
    row = record([{"role": "user", "content": "find x"}], tools_kwargs={"lookup": {"create_kwargs": {"a": 1}}})
    gen = GenerationConfig(n=1, max_new_tokens=64)
    async with AgentProxy(client, tok, gen, mt) as proxy:
        ctx = context(client, tok, group_id, tools=tools, row=row, gen=gen)
        trajs = await run_agent_group(ctx, OpenAIToolAgent(), proxy)
    return client, tools, ctx, trajs


async def test_builtin_openai_agent_tool_loop(tok):
    client, tools, ctx, trajs = await _run_builtin_agent(
        tok, ['<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>', "done"], "grpE")
    assert tools.calls == [("lookup", {"key": "x"}, {"lookup": {"create_kwargs": {"a": 1}}})]
    assert ctx.reward.texts == ["done"]
    # turn 2's prompt: the chat template of the conversation the agent sent, with the tool result
    call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "x"}'}}
    convo = [{"role": "user", "content": "find x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_0", "content": "value of x"}]
    text = tok.apply_chat_template(convo, tools=tools.schemas(), tokenize=False, add_generation_prompt=True)
    assert client.calls[1][0] == tok.encode(text, add_special_tokens=False)
    # the canonical call re-renders into the same tokens: one concat trajectory, tool result masked out
    (t,) = trajs
    assert t.traj_id == "grpE-0" and t.reward == 0.25
    ids, mask = t.ids_np(), t.mask_np().astype(bool)
    eos = [tok.eos_token_id]
    want = [tok.encode(x, add_special_tokens=False) + eos for x in client.texts]
    assert ids[mask].tolist() == want[0] + want[1]
    assert t.logprobs_np()[mask].tolist() == [-0.5] * mask.sum() and (t.versions_np()[mask] == 4).all()
    obs = ids[t.prompt_len:][~mask[t.prompt_len:]].tolist()
    assert obs == client.calls[1][0][len(client.calls[0][0]) + len(want[0]):]


async def test_failing_agent_fails_the_group_and_closes_every_session(tok):
    class Flaky:
        def __init__(self):
            self.cancelled = 0

        async def run(self, data, *, base_url, api_key, **kw):
            c = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)
            try:
                if "-1" in self.who.get(api_key, ""):
                    await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
                    raise RuntimeError("agent bug")
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
            finally:
                await c.close()

    agent = Flaky()
    client = ScriptedClient(tok, ["fine"])

    class Proxy(AgentProxy):
        def open_session(self, group_id, index):
            s = super().open_session(group_id, index)
            agent.who[s.api_key] = f"{group_id}-{index}"
            return s

    agent.who = {}
    async with Proxy(client, tok, GenerationConfig(n=3), MT) as proxy:
        with pytest.raises(RuntimeError, match="agent bug"):
            await asyncio.wait_for(run_agent_group(context(client, tok, "grpF", gen=GenerationConfig(n=3)), agent,
                                                   proxy), 30)
        assert proxy._sessions == {} and agent.cancelled == 2
        # an agent that never calls the model contributes nothing: no trajectory at all → None

        class Idle:
            async def run(self, data, **kw):
                return 1.0

        assert await run_agent_group(context(client, tok, "grpG"), Idle(), proxy) is None


async def test_builtin_openai_agent_tool_loop_with_qwen3_think_blocks(tmp_path):
    """Qwen3's real tokenizer and template: a turn that thinks, then calls a tool in Qwen3's Hermes
    format. The agent sends the conversation back as OpenAI messages; Qwen3's template re-renders the
    think block and the call into exactly the generated tokens, so the session still exports as one
    concat trajectory: the generated tokens trained, the tool result and template glue masked."""
    from areal_like.data.tiny_model import copy_qwen3_tokenizer

    tok = copy_qwen3_tokenizer(str(tmp_path / "qwen3"))
    texts = ['<think>\nI need x.\n</think>\n\n<tool_call>\n{"name": "lookup", "arguments": {"key": "x"}}\n</tool_call>',
             "<think>\nGot it.\n</think>\n\ndone"]
    client, tools, ctx, trajs = await _run_builtin_agent(tok, texts, "grpQ")
    assert tools.calls == [("lookup", {"key": "x"}, {"lookup": {"create_kwargs": {"a": 1}}})]
    # the final message as the agent got it: no reasoning parser, so the think block is in the content
    # (SGLang without --reasoning-parser answers the same way)
    assert ctx.reward.texts == [texts[1]]
    (t,) = trajs  # one concat trajectory: every prompt extended the previous prompt + output
    assert t.traj_id == "grpQ-0"
    ids, mask = t.ids_np(), t.mask_np().astype(bool)
    want = [tok.encode(x, add_special_tokens=False) + [tok.eos_token_id] for x in texts]
    assert ids[mask].tolist() == want[0] + want[1]
    obs = tok.decode(ids[t.prompt_len:][~mask[t.prompt_len:]].tolist(), skip_special_tokens=False)
    assert obs == "\n<|im_start|>user\n<tool_response>\nvalue of x\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


async def test_qwen3_reasoning_parser_splits_think_blocks_and_keeps_the_export(tmp_path):
    """rollout.multi_turn.reasoning_parser=qwen3 (SGLang's parser): the agent gets each think block as
    `reasoning_content` and the answer as `content`; a tool call written inside a think block is not
    called; the built-in agent sends `reasoning_content` back, Qwen3's template re-renders it, and the
    session still exports as one concat trajectory of exactly the generated tokens."""
    from areal_like.data.tiny_model import copy_qwen3_tokenizer

    tok = copy_qwen3_tokenizer(str(tmp_path / "qwen3"))
    texts = ['<think>\nMaybe <tool_call>\n{"name": "lookup", "arguments": {"key": "y"}}\n</tool_call> first?\n'
             '</think>\n\n<tool_call>\n{"name": "lookup", "arguments": {"key": "x"}}\n</tool_call>',
             "<think>\nGot it.\n</think>\n\ndone"]
    mt = msgspec.structs.replace(MT, reasoning_parser="qwen3")
    client, tools, ctx, trajs = await _run_builtin_agent(tok, texts, "grpR", mt)
    assert tools.calls == [("lookup", {"key": "x"}, {"lookup": {"create_kwargs": {"a": 1}}})]  # not "y"
    assert ctx.reward.texts == ["done"]  # the content after </think> (and its blank line)
    # turn 2's prompt carries turn 1's reasoning back: Qwen3's template renders it after the last query
    assert "<think>\nMaybe <tool_call>" in tok.decode(client.calls[1][0])
    (t,) = trajs
    ids, mask = t.ids_np(), t.mask_np().astype(bool)
    want = [tok.encode(x, add_special_tokens=False) + [tok.eos_token_id] for x in texts]
    assert ids[mask].tolist() == want[0] + want[1]


async def test_reasoning_content_in_replies_and_its_switch(tmp_path):
    from areal_like.data.tiny_model import copy_qwen3_tokenizer

    tok = copy_qwen3_tokenizer(str(tmp_path / "qwen3"))
    text = "<think>\nhm\n</think>\n\nfour"
    mt = msgspec.structs.replace(MT, reasoning_parser="qwen3")
    async with AgentProxy(ScriptedClient(tok, [text] * 4), tok, GenerationConfig(n=1, max_new_tokens=32), mt) as proxy:
        s = proxy.open_session("grpS", 0)
        msgs = {"messages": [{"role": "user", "content": "2+2?"}]}
        st, body, _ = await post(proxy.base_url, msgs, s.api_key)
        assert st == 200, body
        m = body["choices"][0]["message"]
        assert m["reasoning_content"] == "\nhm\n" and m["content"] == "four"
        st, body, _ = await post(proxy.base_url, {**msgs, "separate_reasoning": False}, s.api_key)
        m = body["choices"][0]["message"]
        assert "reasoning_content" not in m and m["content"] == text
        st, body, _ = await post(proxy.base_url, {**msgs, "separate_reasoning": "yes"}, s.api_key)
        assert st == 400 and body["error"]["param"] == "separate_reasoning"
        # streamed: the one content delta carries the reasoning too
        c = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s.api_key, max_retries=0, timeout=30)
        try:
            chunks = [ch async for ch in await c.chat.completions.create(model="m", stream=True, **msgs)]
        finally:
            await c.close()
        first = chunks[0].choices[0].delta
        assert first.content == "four" and first.reasoning_content == "\nhm\n"
