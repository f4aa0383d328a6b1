"""Benchmarks, soak and fault drills: measuring tools, outside the runtime package `app`.

    python -m bench sweep|memory|plot ...   whole-pipeline sweeps (bench/__main__.py, docs/bench.md)
    python -m bench.lm                       the speech LM alone on vLLM
    python -m bench.soak / bench.engine_kill / bench.precision
    python -m bench.dispatch_spread / bench.final_call_deviation / bench.ux_measure   (any machine)
    bash bench/gpu/run.sh STEP               GPU recipes on a machine without network (docs/gpu_runs.md);
                                             the GPU checks they call: python -m bench.gpu.<check>
"""
