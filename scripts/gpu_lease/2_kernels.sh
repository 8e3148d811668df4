# Lease call 2 of 3, within 30 s of call 1. kind: left out (call 1's machine, which holds part a).
# carry: .gpu_bundle/part-b  (timeout_s 560)
# Reassemble and unpack the bundle, check its imports, run parity, compiles, tiles, sampler, then the engine
# runs (tokens, speculation: the slowest, last, so a call cut at its limit keeps the kernel numbers).
set -u
. scripts/gpu_lease/env.sh
[ -f "$B/part-a" ] || { echo "no part a here: the machine was not warm; run call 1 again first"; exit 3; }
cp .gpu_bundle/part-b "$B/" && verify part-b "$B/part-b" && unpack || exit 2
use_site
$PY scripts/gpu_lease/import_check.py --site "$B/site" ${GPU_LEASE_DRY_RUN:+--dry-run} | tee "$OUT/imports.txt"
[ "${PIPESTATUS[0]}" = 0 ] || exit 4
run_check call2 535 parity compiles tiles sampler tokens speculation
