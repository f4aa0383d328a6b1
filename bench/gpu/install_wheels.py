"""On the offline GPU machine: `pip install --no-deps --target /tmp/site` the carried wheels in DIR whose
distribution this Python lacks (the image's and vLLM's own versions win), plus those named by
--always (installed over an older one). Used by bench/gpu/run.sh.

    python3 bench/gpu/install_wheels.py DIR [--always NAME ...] [--label WORDS]
"""

import argparse
import importlib.metadata as md
import pathlib
import subprocess
import sys

SITE = "/tmp/site"  # on PYTHONPATH through /tmp/vllm_env.sh (written by `bash bench/gpu/run.sh install`)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--always", nargs="*", default=[], help="distributions installed even when present")
    p.add_argument("--label", default="wheels installed")
    args = p.parse_args()
    todo = []
    for wheel in sorted(pathlib.Path(args.folder).glob("*.whl")):
        name = wheel.name.split("-")[0]
        try:
            md.version(name)
            if name in args.always:
                todo.append(wheel)
        except md.PackageNotFoundError:
            todo.append(wheel)
    print(f"{args.label}:", " ".join(w.name.split("-")[0] for w in todo) or "none needed")
    if todo:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--upgrade",
                        "--target", SITE, *map(str, todo)], check=True)


if __name__ == "__main__":
    main()
