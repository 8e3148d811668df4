# Lease call 3 of 3, within 30 s of call 2. carry: nothing  (timeout_s 580)
# Decode steps (graphs vs eager, and the graph replay alone), the decode step's kernels (profile) and
# serving tok/s vs transformers at 12B dimensions (SERVING_MODEL=e4b saves about a minute); the random
# checkpoint is written once and shared by all three.
set -u
. scripts/gpu_lease/env.sh
[ -d "$B/site" ] || { echo "no unpacked bundle here: the machine was not warm; run calls 1 and 2 again"; exit 3; }
use_site
run_check call3 555 decode profile serving --serving-model "${SERVING_MODEL:-12b_unified}"
