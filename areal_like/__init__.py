"""areal_like: fully asynchronous, decoupled actor-learner RL for LLMs."""

__version__ = "0.1.0"
