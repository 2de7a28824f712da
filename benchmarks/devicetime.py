"""The GPU's own time, from CUPTI's records of every kernel and copy (torch's profiler, device
activity only), by kernel name: what profile_step.py reads around an offline engine's run and
bench_serve.py's `--kernels` around each server's loads (serve_stacks/sitecustomize.py).

CUPTI records the device's work process-wide, whichever thread launched it (a replayed CUDA
graph's kernels each count), so the profiler may start and stop on a thread of its own; it must
stop on the thread it started on. Its records add host time to every launch: readings taken
with it are where the GPU's time goes, not speeds.
"""


class DeviceTimer:
    """Starts at once; `stop()` gives {name: [launches, GPU us]} of every kernel, copy and memset."""

    def __init__(self):
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CUDA])
        self.prof.start()

    def stop(self) -> dict[str, list]:
        self.prof.stop()
        return {e.key: [e.count, e.self_device_time_total] for e in self.prof.key_averages()}


def is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset"))


def tapc_kernel_names() -> set[str]:
    """The Triton kernels of tapc.kernels, by name as CUPTI records them."""
    import tapc.kernels.capture as capture
    import tapc.kernels.edit as edit

    return {n for m in (capture, edit) for n in dir(m) if n.endswith("_kernel")}


def totals(kernels: dict[str, list]) -> dict:
    """GPU ms of kernels and of copies; kernel launches and copies; tapc's own kernels' ms and
    launches."""
    ours = tapc_kernel_names()
    out = {"kernels_ms": 0.0, "copies_ms": 0.0, "launches": 0, "copies": 0, "tapc_ms": 0.0, "tapc_launches": 0}
    for name, (count, us) in kernels.items():
        if is_copy(name):
            out["copies_ms"] += us / 1e3
            out["copies"] += count
            continue
        out["kernels_ms"] += us / 1e3
        out["launches"] += count
        if name in ours:
            out["tapc_ms"] += us / 1e3
            out["tapc_launches"] += count
    return out


def differing(base: dict[str, list], other: dict[str, list], base_steps: float, other_steps: float,
              top: int) -> list[str]:
    """Table rows of the `top` kernels and copies whose GPU ms a step differ most between two
    readings (`DeviceTimer.stop`), each over its own steps: name, base ms, other ms, the
    difference, base launches and other launches a step."""
    def step(got: dict, steps: float, k: str) -> tuple[float, float]:
        count, us = got.get(k, (0, 0.0))
        return us / 1e3 / steps, count / steps

    names = set(base) | set(other)
    diff = {k: step(other, other_steps, k)[0] - step(base, base_steps, k)[0] for k in names}
    rows = []
    for k in sorted(names, key=lambda k: -abs(diff[k]))[:top]:
        (bm, bn), (om, on) = step(base, base_steps, k), step(other, other_steps, k)
        rows.append(f"| `{k[:120]}` | {bm:.3f} | {om:.3f} | {diff[k]:+.3f} | {bn:.2f} | {on:.2f} |")
    return rows
