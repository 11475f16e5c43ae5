"""Generation: the embedded server (`python -m areal_like.engine.server`) and the rollout client.

Import the client from here; the server side (torch, transformers) is imported only by the server
process itself.
"""

from areal_like.engine.client import (GenerationClient, GenerationError, GenerationResult, GenerationTimeout,
                                     parse_reply)

__all__ = ["GenerationClient", "GenerationError", "GenerationResult", "GenerationTimeout", "parse_reply"]
