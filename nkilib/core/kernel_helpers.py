"""Small helpers shared by nkilib kernels (trace-time Python, valid under real NKI too).

Input checks inside traced kernel code (everything an `nki.jit` kernel body calls) go through
`kernel_assert`, which raises the builtin AssertionError: the exception type of the `assert` statement
the NKI Language Guide validates kernel arguments with
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/get-started/nki-language-guide.html),
but raised explicitly, so the check survives `python -O` (a bare `assert` is compiled away there). No
exception class is defined here: the 2.29-2.32 guide admits only classes derived from NKIObject in
traced code. Host-side layers (torch ops, emulation, references, option objects built before the
launch) raise ValueError / TypeError subclasses instead (nkilib.core.options.OptionError);
docs/kernel-structure.md records the decision.
"""


def kernel_fail(msg: str) -> None:
    """Raise AssertionError(msg): a failed kernel-level input check (evaluated at trace time)."""
    raise AssertionError(msg)


def kernel_assert(cond, msg: str) -> None:
    """Raise AssertionError(msg) when `cond` is false (evaluated at trace time; not removed by python -O)."""
    if not cond:
        kernel_fail(msg)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def shard_range(count: int, num_shards: int, shard_id: int):
    """Contiguous split of range(count) into num_shards parts; returns (start, stop) of this shard."""
    base, extra = divmod(count, num_shards)
    start = shard_id * base + min(shard_id, extra)
    return start, start + base + (1 if shard_id < extra else 0)
