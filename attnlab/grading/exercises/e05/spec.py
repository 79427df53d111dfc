"""The references of exercise 05_quadratic_cost (empty in the sandbox): ``attnlab.iomodel``'s counts, three kernels."""

from attnlab import iomodel

MATMUL_SIZE = 1024           # the experiment's matmul: (1024, 1024) @ (1024, 1024), float32
COPY_BYTES = 32 * 2**20      # the experiment's copy: 32 MiB of float32


def attention_flops(batch, heads, n, d):
    """FLOPs of standard attention's two matmuls, S = QK^T and O = PV (2 per multiply-add); softmax not counted."""
    return iomodel.attention_flops(batch, heads, n, d=d)


def step_bytes(batch, heads, n, d, element_size=4):
    """((read, written) of S = QK^T, of P = softmax(S), of O = PV): bytes each step moves to and from memory."""
    io = iomodel.standard_forward_io(batch, heads, n, d=d, bytes_per_element=element_size)
    return tuple((io.parts[step].bytes_read, io.parts[step].bytes_written) for step in ("scores", "softmax", "pv"))


def attention_bytes(batch, heads, n, d, element_size=4):
    """All bytes standard attention reads and writes (4nd + 4n^2 elements per head)."""
    return iomodel.standard_forward_io(batch, heads, n, d=d, bytes_per_element=element_size).total_bytes


def arithmetic_intensity(batch, heads, n, d, element_size=4):
    """FLOPs per byte of standard attention."""
    return iomodel.standard_forward_io(batch, heads, n, d=d, bytes_per_element=element_size).arithmetic_intensity


def is_memory_bound(intensity, peak_flops, bandwidth):
    """True when work of this intensity (FLOP/byte) sits left of the ridge point peak_flops / bandwidth."""
    return iomodel.roofline(intensity, 1.0, machine=iomodel.Machine("", peak_flops, bandwidth, 0, 1)).bound == "memory"


def predict_naive_time(batch, heads, n, d, flop_rate, bandwidth, element_size=4):
    """The roofline's seconds, step by step: sum over the three steps of max(FLOPs / flop_rate, bytes / bandwidth)."""
    io = iomodel.standard_forward_io(batch, heads, n, d=d, bytes_per_element=element_size)
    machine = iomodel.Machine("", flop_rate, bandwidth, 0, 1)
    return sum(iomodel.roofline(part, machine=machine).time_s for part in io.parts.values())


def measure(seed, n, heads, d, repeats):
    """The grader's (matmul, copy, naive attention) seconds: the fastest of ``repeats`` runs, float32, one thread."""
    import torch

    from attnlab.attention import naive_attention
    from attnlab.measure import time_call

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=torch.Generator().manual_seed(seed))
        src, dst = torch.ones(COPY_BYTES // 4), torch.zeros(COPY_BYTES // 4)
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, heads, n, d, generator=g) for _ in range(3))
        return tuple(time_call(f, *args, repeats=repeats, reduce="min")
                     for f, *args in ((torch.matmul, a, a), (dst.copy_, src), (naive_attention, q, k, v)))
    finally:
        torch.set_num_threads(threads)
