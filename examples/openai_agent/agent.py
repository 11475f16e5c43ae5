"""An agent written with the `openai` SDK only — no areal_like import — trained through the proxy.

    rollout.workflow=examples/openai_agent/agent.py:CalculatorAgent

The rollout worker runs `CalculatorAgent().run(row, base_url=…, api_key=…, model=…)` once per sample.
`base_url` points at the worker's OpenAI-compatible proxy, which generates with the current policy
and records every completion's tokens, logprobs and policy versions; the agent only chats. The same
class runs unchanged against any OpenAI-compatible server (vLLM, SGLang, an API) for evaluation.

The episode: ask the question with a `calculator` tool; run the calls the model makes (here, in the
agent: the tool is the user's code); after an answer without a call, ask once to double-check; the
reward — returned as a float — is 1 when the last answer contains the right number. Every completion
of the session is trained; the proxy masks the tool results and the user turns out of the loss.

`AGENT_TRACE_DIR` (optional): append what each completion returned (token ids, logprobs) as JSON lines
there — the test suite checks the trained tokens against it.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re

from openai import AsyncOpenAI

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression such as 37*48+2.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """+, −, × on integers, from the syntax tree (never eval)."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only integers with + - * are supported")
    try:
        return str(ev(ast.parse(expression[:200], mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as e:
        return f"error: {e}"


class CalculatorAgent:
    def __init__(self, max_turns: int = 4, max_tokens: int = 64):
        self.max_turns = max_turns
        self.max_tokens = max_tokens

    async def run(self, data: dict, *, base_url: str, api_key: str, model: str = "default", **_) -> float:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        prompt = data["prompt"]
        messages = [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        answer, checked = "", False
        for _ in range(self.max_turns):
            reply = await client.chat.completions.create(
                model=model, messages=messages, tools=[CALCULATOR], max_tokens=self.max_tokens, logprobs=True,
                extra_body={"return_token_ids": True})
            _trace(reply)
            msg = reply.choices[0].message
            turn = {"role": "assistant", "content": msg.content or ""}
            if msg.tool_calls:
                turn["tool_calls"] = [c.model_dump() for c in msg.tool_calls]
            messages.append(turn)
            if msg.tool_calls:
                for call in msg.tool_calls:
                    try:
                        expr = json.loads(call.function.arguments).get("expression", "")
                    except (json.JSONDecodeError, AttributeError):
                        expr = ""
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(expr))})
                continue
            answer = msg.content or ""
            if checked:
                break
            checked = True
            messages.append({"role": "user", "content": "check it and give just the number."})
        truth = str(data["reward_model"]["ground_truth"])
        numbers = re.findall(r"-?\d+", answer)
        return 1.0 if numbers and numbers[-1] == truth else 0.0


def _trace(reply) -> None:
    out = os.environ.get("AGENT_TRACE_DIR")
    if not out:
        return
    choice = reply.choices[0].model_dump()
    rec = {"token_ids": choice.get("token_ids"),
           "logprobs": [t["logprob"] for t in (choice.get("logprobs") or {}).get("content") or []]}
    with open(os.path.join(out, f"trace-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
