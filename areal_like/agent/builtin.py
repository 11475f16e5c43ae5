"""`openai_agent`: the built-in agent, written the way a user writes one — against the `openai` SDK
only, with the proxy's `base_url` and `api_key` injected (areal_like/agent/runner.py).

    messages = the row's prompt
    repeat up to max_turns assistant turns:
        reply = chat.completions.create(messages, tools=schemas)
        no tool_calls → done
        each call → await tools.call(name, arguments, tools_kwargs) → a `tool` message
    return await score(last assistant text)

Nothing here imports the trainer: the same class runs against any OpenAI-compatible endpoint for
evaluation (pass `score` and, optionally, `tools`). A prompt that outgrows the context (the proxy's
400 `context_length_exceeded`) ends the episode; it is scored on what was said so far.
"""

from __future__ import annotations

import json
from typing import Any


class OpenAIToolAgent:
    """Chat loop with tool calls through `openai.AsyncOpenAI` (module doc)."""

    def __init__(self, *, timeout_s: float = 3600.0):
        # The proxy's generation client has its own timeouts (rollout.request_timeout_s) and answers
        # every failure with a 502: no SDK retries, so a failed generation fails the episode at once.
        self.timeout_s = timeout_s

    async def run(self, data: dict[str, Any], *, base_url: str, api_key: str, model: str = "areal_like",
                  tools: Any = None, max_turns: int = 4, score=None, **_: Any) -> float:
        import openai

        messages = _initial_messages(data.get("prompt"))
        extra = data.get("extra_info") or {}
        tools_kwargs = extra.get("tools_kwargs") if isinstance(extra, dict) else None
        schemas = list(tools.schemas()) if tools is not None else None
        final_text = ""
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=self.timeout_s)
        try:
            for _turn in range(max_turns):
                kwargs: dict[str, Any] = {"model": model, "messages": messages}
                if schemas:
                    kwargs["tools"] = schemas
                try:
                    reply = await client.chat.completions.create(**kwargs)
                except openai.BadRequestError as e:
                    if _code(e) == "context_length_exceeded":
                        break
                    raise
                msg = reply.choices[0].message
                final_text = msg.content or ""
                calls = list(msg.tool_calls or [])
                assistant: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
                reasoning = getattr(msg, "reasoning_content", None)  # the proxy's reasoning parser (SGLang's field)
                if isinstance(reasoning, str):
                    assistant["reasoning_content"] = reasoning  # templates that re-render it (Qwen3) need it
                if calls:
                    assistant["tool_calls"] = [{"id": c.id, "type": "function",
                                                "function": {"name": c.function.name,
                                                             "arguments": c.function.arguments}} for c in calls]
                messages.append(assistant)
                if not calls or tools is None:
                    break
                for c in calls:
                    messages.append({"role": "tool", "tool_call_id": c.id,
                                     "content": await _call_tool(tools, c.function.name, c.function.arguments,
                                                                 tools_kwargs)})
        finally:
            await client.close()
        if score is None:
            raise TypeError("OpenAIToolAgent.run needs score=<async (text) -> float>")
        return float(await score(final_text))


def _initial_messages(prompt: Any) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if prompt is not None and not isinstance(prompt, (dict, bytes)):
        msgs = [dict(m) for m in prompt]  # a list (or a numpy array from parquet) of chat messages
        if msgs and all("role" in m for m in msgs):
            return msgs
    raise ValueError(f"openai_agent: the row's 'prompt' must be a string or a list of chat messages, got "
                     f"{type(prompt).__name__}")


def _code(e: Exception) -> str | None:
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return err.get("code")
    return getattr(e, "code", None)


async def _call_tool(tools: Any, name: str, arguments: str, tools_kwargs: Any) -> str:
    try:
        args = json.loads(arguments) if arguments and arguments.strip() else {}
    except json.JSONDecodeError as e:
        return f"Error: the arguments of {name} are not valid JSON ({e.msg})"
    if not isinstance(args, dict):
        return f"Error: the arguments of {name} must be a JSON object"
    res = await tools.call(name, args, tools_kwargs)
    text = getattr(res, "text", res)
    error = getattr(res, "error", None)
    if error and not text:
        return f"Error: {error}"
    return "" if text is None else str(text)
