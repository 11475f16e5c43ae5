"""OpenAI-compatible agent support: the recording proxy, the group runner and the built-in agent.

A user's agent (`async def run(self, data, **kwargs)`) talks to the policy through the `openai` SDK
pointed at `AgentProxy`; `run_agent_group` runs it n times per prompt and exports the recorded
completions as trajectories (api/workflow.py, module doc, describes the agent shape).
"""

from areal_like.agent.builtin import OpenAIToolAgent
from areal_like.agent.proxy import (EXPORT_STYLES, AgentProxy, Completion, Session, completion_rewards,
                                    session_trajectories)
from areal_like.agent.runner import run_agent_group

__all__ = ["AgentProxy", "Completion", "EXPORT_STYLES", "OpenAIToolAgent", "Session", "completion_rewards",
           "run_agent_group", "session_trajectories"]
