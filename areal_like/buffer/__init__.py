"""The Redis replay buffer: one class (`ReplayBuffer`) owns the stream; `RedisServer` runs Redis."""

from areal_like.buffer.redis_client import RedisCallError, RedisCallTimeout, RedisEndpoint, make_async_client, make_client
from areal_like.buffer.redis_server import RedisServer, RedisServerError
from areal_like.buffer.replay_buffer import (
    BufferFullTimeout,
    CheckpointBehindBuffer,
    Entry,
    ReplayBuffer,
    split_stale,
    staleness,
)

__all__ = [
    "BufferFullTimeout", "CheckpointBehindBuffer", "Entry", "RedisCallError", "RedisCallTimeout", "RedisEndpoint", "RedisServer",
    "RedisServerError", "ReplayBuffer", "make_async_client", "make_client", "split_stale", "staleness",
]
