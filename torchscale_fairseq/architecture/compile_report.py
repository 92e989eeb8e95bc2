"""What ``torch.compile`` could not compile whole in this process, read from dynamo's counters: graph
breaks (a function split into several graphs, eager code between them) and frames run eagerly (dynamo gave
up on a function, e.g. at an exception raised while tracing it; what it calls is then compiled piece by
piece). Both leave the numbers as eager's and cost speed; neither raises."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch._dynamo.utils


def compile_fallbacks() -> dict[str, Any]:
    """``graph_breaks`` and ``frames_run_eager`` counted so far, and ``reasons``: each recorded reason's
    first line with its count, the commonest first."""
    counters = torch._dynamo.utils.counters
    reasons: Counter = Counter()
    for kind in ("graph_break", "unimplemented"):
        for reason, count in counters[kind].items():
            reasons[str(reason).splitlines()[0][:200]] += count
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "frames_run_eager": counters["frames"]["total"] - counters["frames"]["ok"],
            "reasons": dict(reasons.most_common())}


def compiled_graphs() -> int:
    """Graphs dynamo has compiled so far, a recompilation's included (``stats.unique_graphs``; not ``frames``,
    which also counts the frames dynamo only looks at and skips)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def compile_fallback_report() -> str | None:
    """:func:`compile_fallbacks` as one line (the three commonest reasons); ``None`` where everything
    compiled whole."""
    found = compile_fallbacks()
    if not found["graph_breaks"] and not found["frames_run_eager"]:
        return None
    reasons = "; ".join(f"{count} x {reason[:160]}" for reason, count in list(found["reasons"].items())[:3])
    return (f"torch.compile ran {found['frames_run_eager']} function(s) eagerly and broke {found['graph_breaks']} "
            f"graph(s) ({reasons or 'no reason recorded'}): those parts run eagerly or in pieces, slower; "
            "TORCH_LOGS=graph_breaks,recompiles shows where")
