"""The Redis replay buffer: one class (`ReplayBuffer`) owns the stream; `RedisServer` runs Redis;
`areal_like.buffer.staleness` owns the staleness policy (gate capacity, a group's staleness, the
consume-time split, what a learner step takes) and its Lua scripts."""

from areal_like.buffer.redis_client import RedisCallError, RedisCallTimeout, RedisEndpoint, make_async_client, make_client
from areal_like.buffer.redis_server import RedisServer, RedisServerError
from areal_like.buffer.replay_buffer import (
    BufferFullTimeout,
    CheckpointBehindBuffer,
    Entry,
    ReplayBuffer,
)

__all__ = [
    "BufferFullTimeout", "CheckpointBehindBuffer", "Entry", "RedisCallError", "RedisCallTimeout", "RedisEndpoint", "RedisServer",
    "RedisServerError", "ReplayBuffer", "make_async_client", "make_client",
]
