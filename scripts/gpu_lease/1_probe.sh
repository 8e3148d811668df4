# Lease call 1 of 3. kind: left out (an H100, or an H200 when none starts in 90 s; docs/benchmarks.md).
# carry: .gpu_bundle/part-a .gpu_bundle/manifest.json  (timeout_s 300)
# Stash bundle part a in /tmp for call 2, print the machine, run the sections that need only torch.
set -u
. scripts/gpu_lease/env.sh
mkdir -p "$B" && cp .gpu_bundle/part-a .gpu_bundle/manifest.json "$B/" && verify part-a "$B/part-a" || exit 2
probe | tee "$OUT/probe.txt"
run_check call1 275 fallback collectives
