# The lease's three calls end to end on this CPU, after `make gpu-bundle`: the parts verified,
# stashed and unpacked as on the device, the imports checked (import_check.py --dry-run) and every
# gpu_check section started in its call (--smoke), call 1's with the bundle's packages blocked
# (image_only.py). Results land in a temp folder it prints. GPU_LEASE_PYTHON: the venv's Python.
set -u
cd "$(dirname "$0")/../.."
[ -f .gpu_bundle/manifest.json ] && [ -d .gpu_bundle/site ] || { echo "no .gpu_bundle: run make gpu-bundle first"; exit 2; }
GPU_LEASE_PYTHON=${GPU_LEASE_PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
$GPU_LEASE_PYTHON -c "import torch" 2>/dev/null || {
  echo "$GPU_LEASE_PYTHON cannot import torch: set GPU_LEASE_PYTHON to the project's venv Python"; exit 2; }
OUT=$(mktemp -d) GPU_BUNDLE_DIR=$(mktemp -d)
export OUT GPU_BUNDLE_DIR GPU_LEASE_SMOKE=1 GPU_LEASE_DRY_RUN=1 GPU_LEASE_PYTHON
for call in 1_probe 2_kernels 3_serving; do
  echo "== $call"
  bash "scripts/gpu_lease/$call.sh" || { echo "dry run: $call failed (logs in $OUT)"; exit 1; }
done
rm -rf "$GPU_BUNDLE_DIR"
echo "dry run ok: every call ran; results in $OUT"
