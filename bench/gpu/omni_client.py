"""vLLM-Omni's TTS serving benchmark (`vllm bench serve --omni --backend openai-audio-speech`), its code
unchanged and kept outside this repository, run against a studio over HTTP (bench/gpu/omni.sh).

vLLM-Omni's package and CLI `__init__`s import its serving stack (diffusers, its model registry); the client
needs none of it, so empty packages stand in for those three and the subcommand runs as the CLI runs it.
Usage: PYTHONPATH=<unpacked vllm-omni wheel> python bench/gpu/omni_client.py <vllm bench serve arguments>
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from pathlib import Path

STUBBED = ("vllm_omni", "vllm_omni.entrypoints", "vllm_omni.entrypoints.cli", "vllm_omni.entrypoints.cli.benchmark")


def main(argv: list[str]) -> None:
    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or spec.origin is None:
        sys.exit("vllm_omni not found: put the unpacked vllm-omni wheel on PYTHONPATH")
    root = Path(spec.origin).parent  # .../vllm_omni
    for name in STUBBED:  # packages whose __init__ would import the serving stack
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = pkg
    import vllm_omni.benchmarks.patch.patch  # noqa: F401  (registers the omni backends, as the CLI's import does)
    from vllm_omni.entrypoints.cli.benchmark.serve import OmniBenchmarkServingSubcommand as Serve

    parser = argparse.ArgumentParser(prog="vllm bench serve --omni")
    Serve.add_cli_args(parser)
    Serve.cmd(parser.parse_args([a for a in argv if a != "--omni"]))


if __name__ == "__main__":
    main(sys.argv[1:])
