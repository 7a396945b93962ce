"""What a launch costs beyond streaming its bytes, fitted from timed runs of several sizes
(pure: bench_read_ceiling.py and bench_decode_kernels.py time the rows)."""

from __future__ import annotations


def fit_launch_cost(rows: list[dict], min_bytes: int = 16 * 10**6) -> dict:
    """Least-squares t = t0 + bytes / rate over the rows ("bytes", "us") of at least
    min_bytes: t0 is what a launch costs beyond streaming its bytes (ramp, tail, the gap
    between graph nodes), the rate (stream_gbps) that of the stream itself."""
    pts = [(r["bytes"], r["us"]) for r in rows if r["bytes"] >= min_bytes]
    n = len(pts)
    if n < 2 or len({b for b, _ in pts}) < 2:
        raise ValueError(
            f"fit_launch_cost needs two sizes of at least {min_bytes} bytes, got {n} rows"
        )
    mx = sum(b for b, _ in pts) / n
    my = sum(t for _, t in pts) / n
    sxx = sum((b - mx) ** 2 for b, _ in pts)
    slope = sum((b - mx) * (t - my) for b, t in pts) / sxx  # us per byte
    return {
        "t0_us": my - slope * mx,
        "stream_gbps": 1e-3 / slope,
        "cases": n,
        "min_bytes": min_bytes,
    }


def describe_fit(fit: dict) -> str:
    """One line for a bench's output: what every launch costs and the stream's rate."""
    return (
        f"fit over the {fit['cases']} cases of >= {fit['min_bytes'] / 1e6:.0f} MB: every launch"
        f" {fit['t0_us']:.2f} us + bytes at {fit['stream_gbps']:.0f} GB/s"
    )
