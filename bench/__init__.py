"""Benchmarks, soak and fault drills: measuring tools, outside the runtime package `app`.

    python -m bench sweep|memory|plot ...   whole-pipeline sweeps (bench/__main__.py, docs/bench.md)
    python -m bench.lm                       the speech LM alone on vLLM
    python -m bench.soak / bench.engine_kill / bench.precision
"""
