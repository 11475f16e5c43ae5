"""Weight sync between the learner and generation servers: a separate process group, bucketed
broadcast (trainer side: `WeightPusher`; server side: `WeightReceiver`)."""

from areal_like.weights.group import WeightGroup, init_weight_group
from areal_like.weights.push import WeightPusher, WeightPushError, flatten_bucket, make_buckets
from areal_like.weights.receive import WeightReceiver, unflatten_bucket

__all__ = ["WeightGroup", "WeightPushError", "WeightPusher", "WeightReceiver", "flatten_bucket",
           "init_weight_group", "make_buckets", "unflatten_bucket"]
