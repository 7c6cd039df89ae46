"""Training throughput: measured MAC/s of the CPU and the accelerator.

Also the figures assumed when the benchmark is skipped.
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Final

log = logging.getLogger("client_app.device")

# Throughput unit used everywhere here: multiply-accumulates *executed* per
# second while training a small conv net, forward and backward together
# (selection counts one training sample as 3x its forward MACs).
#
# A 256x256 fp32 GEMM runs closer to peak than conv-net training does
# (im2col/packing, memory-bound batch-norm and activations, narrow channels,
# dispatcher overhead). Measured on this project's x86 build machine
# (2 cores, PyTorch 2.14 CPU, SGD with momentum, 32x32x3 input, a 6-conv
# CIFAR-style net of width 8..64): training reached 0.22-0.32 of the GEMM
# rate for 2.6 M MACs/sample, 0.4-0.7 for 10-40 M and 0.85-0.97 for 150 M.
# 0.5 is the middle; it is conservative for the large models, which are the
# ones the time budget rejects.
CPU_CONV_TRAINING_EFFICIENCY: Final = 0.5


# The same ratio on a GPU against a 2048x2048 fp32 GEMM. Small kernels and
# small batches leave most streaming multiprocessors idle and kernel-launch
# overhead dominates, so small conv nets reach roughly 10-30 % of it (not
# measured here: no GPU on the build machine; order of magnitude only).
GPU_CONV_TRAINING_EFFICIENCY: Final = 0.2


# Training throughput per CPU core assumed when the benchmark is skipped
# (``probe_device(benchmark=False)``): a Cortex-A72 core (~1.5e9, GEMM ~3e9
# x 0.5), well below a desktop x86 core (~1.5e10), so that an unmeasured
# device is assumed slow rather than fast.
DEFAULT_CPU_TRAIN_MACS_PER_CORE: Final = 2.0e9


# Training throughput (MAC/s, unit above) of CUDA devices by marketing name,
# used when the GPU benchmark is skipped. Figures are fp32 peak (vendor data
# sheets; 2 FLOP per MAC) times GPU_CONV_TRAINING_EFFICIENCY, rounded.
# Patterns are matched as whole words, longest-first, so "A10" does not match
# "A100". Order of magnitude is what matters.
_CUDA_TRAIN_MACS_BY_NAME: Final[tuple[tuple[str, float], ...]] = (
    ("H200", 6.7e12),  # 67 TFLOPS fp32 -> 33.5e12 MAC/s peak x 0.2
    ("H100", 5.0e12),  # 51-67 TFLOPS fp32 (PCIe/SXM)
    ("A100", 2.0e12),  # 19.5 TFLOPS fp32
    ("L40S", 9.0e12),  # 91.6 TFLOPS fp32
    ("L4", 3.0e12),  # 30.3 TFLOPS fp32
    ("A10", 3.1e12),  # 31.2 TFLOPS fp32
    ("V100", 1.5e12),  # 15.7 TFLOPS fp32
    ("T4", 8.0e11),  # 8.1 TFLOPS fp32
    ("RTX 4090", 8.0e12),  # 82.6 TFLOPS fp32
    ("RTX 3090", 3.5e12),  # 35.6 TFLOPS fp32
    ("Orin", 1.0e11),  # Orin Nano/NX: 1024 CUDA cores @ 0.6-0.8 GHz, ~1.3-1.6 TFLOPS
    ("Xavier", 1.0e11),  # Xavier NX/AGX: 384-512 CUDA cores, ~1.0-1.4 TFLOPS
)


_DEFAULT_CUDA_TRAIN_MACS: Final = 1.0e12


_DEFAULT_JETSON_TRAIN_MACS: Final = 1.0e11


def _check_benchmark_args(seconds: float) -> None:
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"benchmark seconds={seconds!r} is invalid; use a positive duration such as 0.2"
        )


def measure_cpu_macs_per_second(threads: int, seconds: float = 0.2) -> float:
    """Estimate training throughput of the CPU with a short matmul benchmark.

    Runs 256x256 fp32 matmuls with ``torch.set_num_threads(threads)`` for
    about ``seconds`` and at least 20 iterations (the previous thread count is
    restored afterwards), and multiplies the GEMM rate by
    :data:`CPU_CONV_TRAINING_EFFICIENCY` (0.5) to approximate what training a
    small conv net achieves. With one thread the rate is taken over the
    thread's CPU time (``time.thread_time``), so a cgroup CPU quota or other
    processes on the machine do not distort the per-core figure (inside a
    container with ``--cpus 0.5`` wall-clock timing would count the throttled
    periods); with more threads it is taken over wall-clock time.

    Parameters
    ----------
    threads : int
        Intra-op threads to use, at least 1.
    seconds : float
        Approximate benchmark duration.

    Returns
    -------
    float
        Training MAC/s, forward and backward together.

    Raises
    ------
    ValueError
        If ``threads`` < 1 or ``seconds`` is not positive.
    """
    import torch

    if threads < 1:
        raise ValueError(f"benchmark threads={threads!r} is invalid; use at least 1")
    _check_benchmark_args(seconds)
    size = 256
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            a = torch.randn(size, size)
            b = torch.randn(size, size)
            torch.mm(a, b)  # warm-up: thread pool, packing buffers
            iterations = 0
            start = time.perf_counter()
            cpu_start = time.thread_time()
            elapsed = 0.0
            while elapsed < seconds or iterations < 20:
                torch.mm(a, b)
                iterations += 1
                elapsed = time.perf_counter() - start
            cpu_elapsed = time.thread_time() - cpu_start
    finally:
        torch.set_num_threads(previous)
    timed = cpu_elapsed if threads == 1 and cpu_elapsed > 0 else elapsed
    gemm_rate = iterations * size**3 / timed
    log.debug("CPU GEMM %.3g MAC/s with %d threads", gemm_rate, threads)
    return gemm_rate * CPU_CONV_TRAINING_EFFICIENCY


def measure_accelerator_macs_per_second(device: str, seconds: float = 0.2) -> float:
    """Estimate training throughput of a CUDA or MPS device with a matmul benchmark.

    Runs 2048x2048 fp32 matmuls on ``device`` for about ``seconds``,
    synchronising before reading the clock, and multiplies the GEMM rate by
    :data:`GPU_CONV_TRAINING_EFFICIENCY` (0.2).

    Parameters
    ----------
    device : str
        ``"cuda"`` or ``"mps"``.
    seconds : float
        Approximate benchmark duration.

    Returns
    -------
    float
        Training MAC/s, forward and backward together.

    Raises
    ------
    ValueError
        If ``device`` is not ``"cuda"`` or ``"mps"`` or ``seconds`` is not positive.
    """
    import torch

    if device not in ("cuda", "mps"):
        raise ValueError(f"accelerator benchmark device {device!r} is invalid; use 'cuda' or 'mps'")
    _check_benchmark_args(seconds)

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()
        else:
            torch.mps.synchronize()

    size = 2048
    with torch.no_grad():
        a = torch.randn(size, size, device=device)
        b = torch.randn(size, size, device=device)
        torch.mm(a, b)
        synchronize()
        iterations = 0
        start = time.perf_counter()
        elapsed = 0.0
        while elapsed < seconds:
            for _ in range(4):
                torch.mm(a, b)
            synchronize()
            iterations += 4
            elapsed = time.perf_counter() - start
    gemm_rate = iterations * size**3 / elapsed
    log.debug("%s GEMM %.3g MAC/s", device, gemm_rate)
    return gemm_rate * GPU_CONV_TRAINING_EFFICIENCY


def _cuda_macs_from_name(name: str, *, is_jetson: bool) -> float:
    """Look up a CUDA device's nominal training throughput by its name."""
    for pattern, macs in sorted(_CUDA_TRAIN_MACS_BY_NAME, key=lambda item: -len(item[0])):
        word = rf"(?<![A-Za-z0-9]){re.escape(pattern)}(?![A-Za-z0-9])"
        if re.search(word, name, flags=re.IGNORECASE):
            return macs
    default = _DEFAULT_JETSON_TRAIN_MACS if is_jetson else _DEFAULT_CUDA_TRAIN_MACS
    log.debug("no throughput figure for CUDA device %r; assuming %.3g MAC/s", name, default)
    return default
