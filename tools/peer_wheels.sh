#!/bin/bash
# The wheels of the bench's optional Thunder peer (--impl thunder,thunder-graph) for the GPU image
# (Python 3.12, torch 2.11, no package index there), fetched here into .whl/ (git-ignored):
#   bash tools/peer_wheels.sh          then carry [".whl"] in the device call and, there, first:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
# lightning-thunder 0.2.6's requirements the image already has (torch, numpy, networkx, mpmath,
# packaging, typing-extensions) are left out.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d .whl lightning-thunder==0.2.6 looseversion==1.3.0 lightning-utilities==0.15.3 optree==0.20.0 \
  opt-einsum==3.4.0 dill==0.4.1
ls .whl
