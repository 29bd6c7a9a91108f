"""Host time per layer of an eager decode step, against the same step replayed from a CUDA graph: what
`nemo-dapo plan` guesses as ``plan.assume.eager_layer_ms`` for an engine without CUDA graphs (the pinned TensorRT-LLM).

    python benchmarks/eager_launch.py            # CUDA if present: layers 8, 16, 32, 64 at width 512, 50 steps each
    python benchmarks/eager_launch.py --quick    # 2 and 4 layers on the CPU (what the smoke test runs)

The model is a stack of plain PyTorch decoder layers of the Llama / Qwen shape (RMSNorm, q / k / v / o projections,
attention over a preallocated KV cache with the new token written in place, SwiGLU MLP): about the kernels of a real
layer, at a width so small that the GPU's own work per layer is a few microseconds, so a decode step of batch 1 takes
what the host needs to launch its kernels. The step time against the layer count is a line; its slope is the host's
time per layer and its intercept the step's fixed cost.
  ours      the eager step (what an engine without CUDA graphs runs)
  baseline  the same step captured once in a ``torch.cuda.CUDAGraph`` and replayed (CUDA only): one launch a step
Fused engine kernels (TensorRT-LLM's PyTorch backend fuses norms, QKV and gate / up) launch fewer kernels a layer
than this plain stack, so on the same host its slope bounds theirs from above. Ends with one line
``RESULT key=value ...`` (milliseconds; ``graph_*`` are ``nan`` on the CPU).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nemo_dapo.cluster.plan_assumptions import EAGER_LAYER_MS_RANGE  # noqa: E402


class Layer(nn.Module):
    """One decoder layer at batch 1: ``x`` [1, 1, width]; the KV cache [1, heads, context, head_dim] per layer, the new
    token's key and value written at ``pos`` (a one-element long tensor, so a captured graph replays any position)."""

    def __init__(self, width: int, heads: int, context: int, device, dtype):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        kw = dict(device=device, dtype=dtype)
        self.norm1, self.norm2 = nn.RMSNorm(width, **kw), nn.RMSNorm(width, **kw)
        self.qkv = nn.ModuleList(nn.Linear(width, width, **kw) for _ in range(3))
        self.o = nn.Linear(width, width, bias=False, **kw)
        self.gate = nn.Linear(width, 2 * width, bias=False, **kw)
        self.up = nn.Linear(width, 2 * width, bias=False, **kw)
        self.down = nn.Linear(2 * width, width, bias=False, **kw)
        shape = (1, heads, context, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, **kw))
        self.register_buffer("v_cache", torch.zeros(shape, **kw))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = (proj(h).view(1, 1, self.heads, self.head_dim).transpose(1, 2) for proj in self.qkv)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        a = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache)
        x = x + self.o(a.transpose(1, 2).reshape(1, 1, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def step_ms(layers: nn.ModuleList, x, pos, *, steps: int, graph: bool, device) -> float:
    """Median milliseconds of one decode step (every layer once), eager or replayed from a captured CUDA graph."""
    def forward():
        h = x
        for layer in layers:
            h = layer(h, pos)
        return h

    run = forward
    if graph:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up on a side stream, as CUDA graph capture requires
            for _ in range(3):
                forward()
        torch.cuda.current_stream(device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            forward()
        run = g.replay
    times = []
    for _ in range(steps + 5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[5:])


def fit(points: list) -> tuple:
    """(slope, intercept) of the least-squares line through (layers, ms) points."""
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return slope, my - slope * mx


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="2 and 4 layers, width 64, 10 steps, on the CPU")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.width, a.heads, a.context, a.steps = [2, 4], 64, 4, 16, 10
    device = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    eager, graph = [], []
    with torch.inference_mode():
        for n in a.layers:
            layers = nn.ModuleList(Layer(a.width, a.heads, a.context, device, dtype) for _ in range(n))
            x = torch.randn(1, 1, a.width, device=device, dtype=dtype)
            pos = torch.tensor([a.context - 1], device=device)
            eager.append((n, step_ms(layers, x, pos, steps=a.steps, graph=False, device=device)))
            if device.type == "cuda":
                graph.append((n, step_ms(layers, x, pos, steps=a.steps, graph=True, device=device)))
            print(f"{n:3d} layers: eager {eager[-1][1]:7.3f} ms"
                  + (f", CUDA graph {graph[-1][1]:7.3f} ms" if graph else "") + " a step (median)")
    e_slope, e_fixed = fit(eager)
    g_slope, g_fixed = fit(graph) if graph else (math.nan, math.nan)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    low, high = EAGER_LAYER_MS_RANGE
    print(f"{name}: eager {e_slope:.4f} ms a layer + {e_fixed:.3f} ms; CUDA graph {g_slope:.4f} ms a layer + "
          f"{g_fixed:.3f} ms (the planner's range for an engine's fused eager layer: {low}-{high} ms)")
    print(f"RESULT device={name.replace(' ', '_')} eager_ms_per_layer={e_slope:.4f} eager_fixed_ms={e_fixed:.3f} "
          f"graph_ms_per_layer={g_slope:.4f} graph_fixed_ms={g_fixed:.3f} "
          f"ratio={e_slope / g_slope if graph and g_slope > 0 else math.nan:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
