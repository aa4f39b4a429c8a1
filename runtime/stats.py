"""Counters of everything the runtime does; ``deferfuse.metrics()`` returns a copy."""
from __future__ import annotations

from collections import Counter


def fresh() -> dict:
    return {
        "ops_recorded": 0,          # ops appended to a defer trace
        "ops_eager": 0,             # ops run one by one (strict/debug)
        "regions_run": 0,           # fused regions executed
        "compiles": 0,              # compile-cache misses (region or per-op program)
        "op_compiles": 0,           # ... of which per-op programs (strict/debug)
        "region_compiles": 0,       # ... of which fused regions
        "cache_hits": 0,            # in-process region cache hits
        "region_hit_path": Counter(),   # flushes run straight from a region hit, and why the
                                        # others took the full path (NOTE [region hits])
        "disk_cache_hits": 0,       # compiles answered by an on-disk cache (not in "compiles")
        "program_disk_hits": 0,     # ... of which whole programs loaded from deferfuse's store
        "jax_disk_hits": 0,         # ... of which XLA compiles answered by JAX's cache
        "recompiles": 0,            # region structures compiled again with new shapes
        "compile_seconds": 0.0,
        "execute_seconds": 0.0,
        "regions_dispatched": 0,    # ... of which called on the dispatch thread (NOTE [in flight])
        "dispatch_wait_seconds": 0.0,  # host time waiting for a dispatched call to return
        "syncs": Counter(),         # reason -> count
        "sync_sites": Counter(),    # (reason, 'file:line') -> count
        "cpu_fallbacks": Counter(),  # op name -> count
        "shape_fallbacks": 0,       # regions run op by op because their shapes kept changing
        "region_evictions": 0,      # times every compiled region was dropped (max_regions)
        "shape_splits": 0,          # regions split into shape-stable and shape-changing pieces
        "bucketed_runs": 0,         # regions run padded in a bucket's program (NOTE [buckets])
        "bucket_programs": 0,       # ... programs made (or loaded) for new buckets
        "bucketed_ops": 0,          # ops run padded in a bucket in strict/debug mode
        "bucket_refusals": Counter(),   # region structures that cannot run padded: why
        "lazy_cuts": 0,             # bucket outputs left at their bucket's shape (NOTE [lazy cuts])
        "lazy_cuts_read": 0,        # ... cut to their exact shape where something read them
        "lazy_cuts_padded": 0,      # ... padded for a bucket run straight from the padded array
        "bucket_misfits": 0,        # versions of a bucketed structure whose sizes did not fit
        "packed_padded": 0,         # varlen boundaries padded to a bucket (NOTE [packed boundaries])
        "setup_splits": 0,          # traces whose leading setup ops ran first (NOTE [setup first])
        "needed_first_splits": 0,   # syncs that waited only for the ops the value read needs
        "loop_splits": 0,           # traces of many loop iterations run one region per iteration
        "budget_splits": 0,         # regions split to stay under DEFERFUSE_MEMORY_BUDGET
        "failed_checks": 0,         # programs whose index checks failed (their dependents failed)
        "hash_collisions": 0,       # region keys that matched a region of another structure
        "dynamo_graphs": 0,         # graphs Dynamo handed to the tpu backend (torch.compile)
        "compiled_graphs": 0,       # ... forward, backward and inference graphs made of them
        "graph_compiles": 0,        # ... programs compiled for them (a new shape: one more)
        "compiled_calls": 0,        # ... calls of those graphs
        "graphs_run_eagerly": 0,    # graphs with an op no lowering covers, run op by op
        "graph_fallback_reasons": [],
        "graphs_with_collectives": 0,   # graphs run as one program over a process group
        "graph_calls_op_by_op": 0,  # ... calls run op by op: ranks' input shapes differed
        "graph_recompiles": [],     # Dynamo frames compiled again (a guard failed), in words
        "donated_bytes": 0,
        "elided_bytes": 0,          # intermediates never materialised as buffers
        "peak_region": None,
        "miss_reasons": [],         # (region summary, what differed) for the report
        "collectives": Counter(),   # collective kind -> count (deferfuse.distributed)
        "collective_bytes": 0,      # bytes this process gave to collectives
        "collective_seconds": 0.0,  # host time in collectives: checks, dispatch, waits
        "collective_check_seconds": 0.0,   # ... of which agreeing with the other ranks
        "collective_wait_seconds": 0.0,    # ... of which waiting for the results
        "collective_compiles": 0,   # collective programs compiled
        "collective_evictions": 0,  # times the collective program cache was dropped (bounded)
    }


S = fresh()


def reset() -> None:
    S.clear()
    S.update(fresh())
