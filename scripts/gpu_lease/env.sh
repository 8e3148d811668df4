# Sourced by each lease call (1_probe.sh, 2_kernels.sh, 3_serving.sh): paths and the steps they share.
# On the device: B=/tmp/gpu_bundle (survives between calls only while the machine stays warm, 30 s).
# The dry run (dry_run.sh) points B, OUT and the Python elsewhere and runs gpu_check with --smoke.
B=${GPU_BUNDLE_DIR:-/tmp/gpu_bundle}
PY=${GPU_LEASE_PYTHON:-python3}
: "${OUT:?set OUT: the output folder (the device tool sets it)}"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src

verify() {   # verify NAME FILE: FILE's sha256 is the manifest's for NAME (a part or the archive)
  $PY -c 'import hashlib, json, sys
m = json.load(open(sys.argv[1])); name, path = sys.argv[2], sys.argv[3]
want = m["archive_sha256"] if name == m["archive"] else {p["name"]: p["sha256"] for p in m["parts"]}[name]
got = hashlib.sha256(open(path, "rb").read()).hexdigest()
sys.exit(0 if got == want else f"{name}: sha256 {got} differs from the manifest ({want})")' "$B/manifest.json" "$1" "$2"
}

probe() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv || true
  $PY -c 'import sys, torch, triton
print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)
if torch.cuda.is_available(): print(torch.cuda.get_device_name(), "sm", torch.cuda.get_device_capability())'
  df -h /tmp | tail -1
}

unpack() {   # the parts -> $B/site, each step checked against the manifest
  cat "$B"/part-? > "$B/site.tar.xz" && verify site.tar.xz "$B/site.tar.xz" || return 1
  $PY -c 'import sys, tarfile
with tarfile.open(sys.argv[1]) as t: t.extractall(sys.argv[2], filter="data")' "$B/site.tar.xz" "$B" && rm "$B/site.tar.xz"
}

use_site() {   # the cutlass .pth is not read for a PYTHONPATH folder: add its dsl_packages ourselves
  local site=$B/site
  SITE_ON=1
  [ -n "${GPU_LEASE_DRY_RUN:-}" ] && return   # cp312 builds: this CPU's Python cannot load them
  export PYTHONPATH=$PWD/src:$site:$site/nvidia_cutlass_dsl/dsl_packages
}

seconds_left() {   # seconds_left DEADLINE: until DEADLINE s after the call began, or until LEASE_LEFT_S
  # (the device time status said was left as the call was made) less 25 s, if sooner: the tool cuts a call
  # at the session's device time: what is under $OUT comes back, but the printed tail is lost and the section
  # running then is half-written. LEASE_LEFT_S counts from the call's start: on a call that starts a machine,
  # pass budget_left_s less the start (60-120 s)
  local deadline=$1
  [ -n "${LEASE_LEFT_S:-}" ] && (( LEASE_LEFT_S - 25 < deadline )) && deadline=$(( LEASE_LEFT_S - 25 ))
  local limit=$(( deadline - SECONDS ))
  (( limit > 10 )) && echo "$limit" || echo 10   # (timeout 0 would mean no limit at all)
}

run_check() {   # run_check NAME DEADLINE SECTION...: gpu_check's sections until seconds_left DEADLINE;
  local name=$1 limit pre=; limit=$(seconds_left "$2"); shift 2   # JSON and log under $OUT
  # the dry run's calls before use_site: the bundle's packages blocked, as on the device
  [ -n "${GPU_LEASE_DRY_RUN:-}" ] && [ -z "${SITE_ON:-}" ] && pre="scripts/gpu_lease/image_only.py .gpu_bundle/site"
  timeout "$limit" $PY $pre bench/gpu_check.py ${GPU_LEASE_SMOKE:+--smoke} --only "$@" --out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v " INFO " "$OUT/$name.log" | tail -50
  echo "$name: exit $rc"
  return $rc
}
