#!/usr/bin/env bash
# Sourced on the lent H200 after scripts/gpu_env.sh: installs into /tmp/site the wheels carried in
# .wheels_extra/ (git-ignored) whose distribution the image lacks -- what `python app.py` needs
# beyond vLLM and the pipeline (Gradio and its dependencies, uvicorn, python-multipart, cffi for
# soundfile). Wheels of a distribution already there are skipped, so the image's own versions win.
# Fill .wheels_extra here with (py3.12, manylinux x86_64, --no-deps), about 49 MB, carried beside .carry2:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
#     -d .wheels_extra cffi pycparser $(grep -E '^(gradio|gradio_client|hf-gradio|brotli|groovy|orjson|pydub|
#     python-multipart|safehttpx|semantic-version|tomlkit|typer|shellingham|rich|markdown-it-py|mdurl|Pygments|click|
#     uvicorn|h11|httptools|websockets|pandas|pytz|tzdata|python-dateutil|fsspec|anyio|httpx|httpcore|idna|certifi|
#     Jinja2|MarkupSafe|PyYAML|typing_extensions|annotated-doc|prometheus_client)==' <(pip freeze))
[ -d .wheels_extra ] || { echo "no .wheels_extra folder was carried" >&2; return 3; }
python3 scripts/install_missing_wheels.py .wheels_extra --label "extra wheels installed" || return 4
