"""Write a random-weight CosyVoice2 model folder in the official layout (the library is app/model/random).

    python -m app.tools.make_model OUT --size tiny|full [--seed N] [--tokenizer-from DIR] [--force]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from app.model.random import SIZES, make_model
from app.model.random.make import compare_official


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.tools.make_model", description=__doc__.split("\n")[0],
                                epilog="Prints a JSON report. Design notes: docs/design.md.")
    p.add_argument("out", type=Path)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-from", type=Path, default=None,
                   help="copy vocab.json/merges.txt of a real Qwen2 tokenizer instead of building one")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    try:
        report = make_model(args.out, SIZES[args.size], args.seed, args.tokenizer_from, args.force)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.size == "full":
        mismatches = compare_official(report)
        report["equals_official_counts"] = not mismatches
        for line in mismatches:
            print("MISMATCH", line, file=sys.stderr)
    print(json.dumps(report))
    return 0 if report.get("equals_official_counts", True) else 1


if __name__ == "__main__":
    sys.exit(main())
