"""Pure-Python scheduling: request state, block manager, batch packing, policies, predictor.

Nothing here imports torch, zmq or a web framework (an import-linter contract enforces it),
so the live engine and the discrete-event simulator run exactly this code.

    request.py, block_manager.py, batch.py   state, KV blocks, the Batch sent to the runner
    profile_table.py -> predictor.py          per-layer tables -> batch time in microseconds
    prefill_time_cache.py -> urgency.py       T(l) (Medha Alg. 3) -> deadlines, slack
    policies.py, justitia.py, priority_index  order without re-sorting every iteration
    packer.py                                 time budget, adaptive chunks (Medha Alg. 1-2)
    preemption.py                             recompute or swap under KV pressure
    scheduler.py (+ config.py)                the per-iteration loop the engine calls
    offline_driver.py                         fake clock + KV-checking fake runner
"""
