"""Small helpers shared by nkilib kernels (trace-time Python, valid under real NKI too)."""


class KernelInputError(ValueError):
    """A kernel argument is invalid; the message names the argument, expected and received values."""


def kernel_assert(cond, msg: str) -> None:
    """Raise KernelInputError(msg) when `cond` is false (evaluated at trace time)."""
    if not cond:
        raise KernelInputError(msg)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def shard_range(count: int, num_shards: int, shard_id: int):
    """Contiguous split of range(count) into num_shards parts; returns (start, stop) of this shard."""
    base, extra = divmod(count, num_shards)
    start = shard_id * base + min(shard_id, extra)
    return start, start + base + (1 if shard_id < extra else 0)
