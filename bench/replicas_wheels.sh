#!/usr/bin/env bash
# The wheels bench/replicas_overhead.sh needs on the lent GPU machine, whose image has torch,
# transformers, numpy, httpx ... but neither Ray nor the serving stack (../shared/GUIDE.md, 6):
# Ray Serve 2.60 and everything it requires that neither the image nor .devwheels (the serving
# stack: fastapi, starlette, uvicorn, pydantic; ../shared/tools/device-wheels.sh) has, as cp312
# x86-64 wheels, in two folders that each fit in one call's 64 MiB carry:
#   OUT/ray   ray 2.60.0 without ray/jars (its Java API) and the dashboard's source maps: ~46 MB
#             (the published wheel is 79 MB)
#   OUT/deps  the rest, less what the image has: ~29 MB
#   usage: bench/replicas_wheels.sh OUT
# On the GPU machine, two calls back to back (a warm machine keeps /tmp between them): the first
# carries OUT/ray and copies it to /tmp/qs-ray; the second carries OUT/deps and .devwheels and runs
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/qs-ray/*.whl OUT/deps/*.whl .devwheels/*.whl
#   python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site .
#   bench/replicas_overhead.sh /tmp/site OUT_RESULTS
set -euo pipefail
out=$(realpath -m "$1")
mkdir -p "$out/ray" "$out/deps"
all=$(mktemp -d)
trap 'rm -rf "$all"' EXIT
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$all" "ray[serve]==2.60.0"
# in the image already (a second copy on PYTHONPATH would shadow torch's own), or not needed there
# (py-spy: .devwheels/tools carries it); aiohttp and its parts stay (Ray needs aiohttp >= 3.14.4)
skip='^(numpy|pyyaml|packaging|filelock|typing_extensions|jinja2|markupsafe|h11|anyio|prometheus_client|click|idna|certifi|sniffio'
skip+='|uvloop|py_spy|requests|urllib3|charset_normalizer|six|wrapt|attrs|msgpack'
# and the serving stack, which ../shared/tools/device-wheels.sh's folder (.devwheels) carries beside these
skip+='|fastapi|starlette|uvicorn|pydantic|pydantic_core|annotated_doc|annotated_types|typing_inspection|opentelemetry_api)-'
for wheel in "$all"/*.whl; do
  name=$(basename "$wheel")
  if [[ $name == ray-2.60.0-* ]]; then
    python3 - "$wheel" "$out/ray/$name" <<'EOF'
import sys
import zipfile

def dropped(name):
    return name.startswith("ray/jars/") or name.endswith(".js.map")

with zipfile.ZipFile(sys.argv[1]) as src, zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if dropped(item.filename):
            continue
        data = src.read(item.filename)
        if item.filename.endswith(".dist-info/RECORD"):  # pip installs what RECORD lists
            data = b"\n".join(line for line in data.split(b"\n") if not dropped(line.split(b",")[0].decode()))
        dst.writestr(item, data)
EOF
  elif ! tr '[:upper:]' '[:lower:]' <<< "$name" | grep -Eq "$skip"; then
    cp "$wheel" "$out/deps/"
  fi
done
du -sh "$out/ray" "$out/deps"
