# Sourced by the bench/gpu_*.sh device scripts: `. "$(dirname "$0")/device_env.sh" NAME`.
# $OUT (default /tmp/NAME) made, unbuffered and offline Python, the wheels carried in .whl/ (run's carry: [".whl"])
# installed into /tmp/carried and put on PYTHONPATH, and stage() to mark a stage with the time in the log.
OUT=${OUT:-/tmp/${1:-kiln-device}}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
for w in .whl/*.whl; do [ -e "$w" ] && pip install -q --no-deps --target /tmp/carried "$w" 2>/dev/null; done
[ -d /tmp/carried ] && export PYTHONPATH=/tmp/carried
stage() { echo "== $(date +%T) $*"; }
