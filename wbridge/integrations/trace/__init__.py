"""Trace an engine's own ``load_weights`` to find where every canonical element lands.

How it works
------------
Each parameter of the module is swapped for a ``float64`` shadow filled with NaN. The engine's
``load_weights(iter[(hf_name, full_tensor)])`` then runs ``1 + max_ndim`` times on placeholders
that cost no memory: in pass 0 every element of canonical tensor ``t`` holds a random tag of ``t``
(an expanded scalar); in pass ``d + 1`` every element holds a random tag of its index along dim
``d`` (an expanded vector). Reading the shadows back gives, for each parameter element, which
canonical tensor and which index it came from, or NaN: never written (unmapped, e.g. vocabulary
padding). A value that is no tag at all means the loader computed something (a scale, a sum, a
cast), which is reported naming the parameter; tags are random, so any transform other than a
copy is caught. Canonical elements must land in increasing order inside each parameter; a loader
that permutes them otherwise (a transpose, a RoPE permutation) is reported as not a slicing.

The element map of each parameter is then compressed into planner declarations: ``Shard``
(possibly ``padded``), ``Fused`` along one dim, ``Stack`` or ``Flat``; where no single declaration
fits (a stacked ``[E, 2I, H]`` expert tensor holding ``[gate_e; up_e]`` per expert), the parameter is
split into views ``param[i]`` along dim 0, each declared on its own.

Results are plain data (``TraceResult``), cached as JSON keyed by model config, engine version and
rank (``cached_trace``; ``traced`` builds that key for an engine's trace), and can be replicated by
name pattern: ``expand_layers`` copies the layout of one traced decoder layer to every layer of the
same kind, ``expand_experts`` the layout of the traced experts to a full expert map, so a
1T-parameter model is extracted from a trace of a two-layer, few-expert model.
"""

from .names import check_declarations, expand_experts, expand_layers, with_shapes
from .result import TraceResult, cache_key, cached_trace, canonical_shapes, traced
from .tracing import trace_load_weights

__all__ = [
    "TraceResult",
    "cache_key",
    "cached_trace",
    "canonical_shapes",
    "check_declarations",
    "expand_experts",
    "expand_layers",
    "trace_load_weights",
    "traced",
    "with_shapes",
]
