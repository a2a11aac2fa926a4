"""Which of a configuration's fresh-forest steps are steady, and speedups over them.

``dtree bench`` reports the first and second steps apart (compilation, autotuning, the
allocator's growth) and the steady figures over steps 3..N. A later step can still pay a
one-time cost: FlexAttention's tree mask recompiled on the sixth of eight 64k agentic forests
(12.1 s against 2.7 s, ``benchmarks/results/h200/session_ab/low8``), which made the mask's
steady mean 4.2 s and the headline 1.92x where the other five forests gave 1.20x. Such a step
(over :data:`OUTLIER_FACTOR` times the median of steps 3..N, with three or more of them) is
left out of the steady figures, and a speedup counts only the steps both sides kept.
"""

from __future__ import annotations

import statistics

__all__ = ["OUTLIER_FACTOR", "outlier_note", "steady_ratio", "steady_split"]

OUTLIER_FACTOR = 2.0  # a steady step over this many times the steady median is not steady


def steady_split(times: list[float]) -> tuple[list[int], list[int]]:
    """(steady steps, outliers) among steps 3..N of ``times`` (0-based indices): with three or
    more, a step over :data:`OUTLIER_FACTOR` times their median is an outlier."""
    steady = list(range(2, len(times)))
    if len(steady) < 3:
        return steady, []
    median = statistics.median(times[i] for i in steady)
    outliers = [i for i in steady if times[i] > OUTLIER_FACTOR * median]
    return [i for i in steady if i not in outliers], outliers


def steady_ratio(slow: dict, fast: dict) -> float | None:
    """How many times faster ``fast`` ran than ``slow`` (result rows, ``as_dict()``):
    the ratio of their summed steady step times over the steady steps both ran, so both
    sides saw the same forests (an outlier of either side is a step of neither). None when
    they share none."""
    common = sorted(set(slow.get("steady_steps") or ()) & set(fast.get("steady_steps") or ()))
    if not common:
        return None
    return sum(slow["step_times_s"][i] for i in common) / sum(fast["step_times_s"][i] for i in common)


def outlier_note(results: list[dict]) -> list[str]:
    """The report's lines naming the steady steps each configuration (result rows, ``as_dict()``)
    left out (:func:`steady_split`); none when none was."""
    out = [f"`{r['config']}`: " + ", ".join(f"step {i + 1} ({r['step_times_s'][i]:.3f} s)" for i in r["steady_outliers"])
           for r in results if r.get("steady_outliers")]
    if not out:
        return []
    return ["", f"Left out of the steady figures and of every speedup, on both sides (over {OUTLIER_FACTOR:g}x the "
            "median of the configuration's steps 3..N: a recompilation for a new shape, or a stalled host): "
            + "; ".join(out) + "."]
