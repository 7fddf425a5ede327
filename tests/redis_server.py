"""The tests' real redis-server: the same launcher `spyglass serve` uses."""

from services.local_redis import LocalRedis as RedisServer
from services.local_redis import free_port

__all__ = ["RedisServer", "free_port"]
