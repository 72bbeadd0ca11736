#!/usr/bin/env bash
# Device probe 2: which missing order between the caller's stream and the graphs' makes graphed layers NaN when the
# GPU is shared?
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
SMALL="--preset tiny --T 1024 --max-docs 40 --steps 30 --device cuda --scopes layer"
demo() {  # demo NAME VARIANT [env...]
  local name=$1 variant=$2; shift 2
  local t0=$(date +%s)
  env "$@" timeout 45 python3 diag/demo_variant.py "$variant" demo $SMALL --out-dir /tmp/demo-$name --overwrite >/tmp/demo-$name.log 2>&1
  echo "[$name] rc=$? $(( $(date +%s) - t0 ))s: $(grep -E 'vs eager|Error' /tmp/demo-$name.log | tr '\n' '|' | cut -c1-200)"
}
python3 diag/hog.py & HOG=$!
sleep 4
demo plain plain
demo record-results record-results
demo wait-after-backward wait-after-backward
demo single-stream single-stream
kill $HOG; wait $HOG 2>/dev/null
timeout 60 python3 -m pytest "tests/cuda/test_doc_mask_cuda.py::test_matches_float64_reference_with_grads[1-causal]" -q -m cuda --tb=line -p no:cacheprovider -p no:logging 2>&1 | grep -E "^E |Error:|error:" | grep -v DEBUG | head -12
