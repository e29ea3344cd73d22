"""A test's own Ray instance."""

import ray


def start_ray(**kwargs) -> None:
    """ray.init for a test's own Ray. An engine built with the default layout (Ray for ssd/auto on CPU) leaves
    the Ray it started running after close, as it does for a user: stop that one first."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(**kwargs)
