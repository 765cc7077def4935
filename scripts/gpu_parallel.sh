#!/usr/bin/env bash
# Run several named GPU jobs at once on a lent machine (each its own process and, where it uses Ray, its own local
# cluster), each under its own time limit; logs and reports land in $OUT/w and come back packed as results.tgz
# (a device call returns at most 8 files). Jobs: JOBS="name=command;name=command" (run from the repo root after
# `source .whl/unpack`). The batteries and GPU tests are independent; timings are not taken this way.
set -u
OUT=${OUT:-/tmp/out}; W=$OUT/w; mkdir -p "$W"
LIMIT=${LIMIT:-400}
nvidia-smi -L
python3 -m memra_pp.cli make-tiny ~/.cache/memra_pp/tiny-qwen3_5-vision --vision >/dev/null
IFS=';' read -ra jobs <<< "$JOBS"
for j in "${jobs[@]}"; do
  name=${j%%=*}; cmd=${j#*=}
  ( start=$(date +%s); timeout -k 10 "$LIMIT" bash -c "$cmd" > "$W/$name.log" 2>&1; rc=$?
    echo "=== $name rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$W/summary.txt" ) &
done
wait
cat "$W/summary.txt"
tar czf "$OUT/results.tgz" -C "$W" .
for f in "$W"/*.log; do echo "--- $(basename "$f")"; grep -E "PASS|FAIL|SKIP|passed|failed|Error|error|rc=" "$f" | grep -v "logging.cc" | tail -n 30; done
