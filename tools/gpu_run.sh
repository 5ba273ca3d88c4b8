#!/usr/bin/env bash
# One-shot serving benchmark on the GPU machine, from the repository root:
#
#   bash tools/gpu_run.sh                          # MD3 then MD2, ours only
#   PEER=1 MODELS=md3 bash tools/gpu_run.sh        # MD3, with Kestrel side by side (needs .peer/carry)
#
# With today's numpy checkpoint writer (MD3 with FP8 experts: minutes of one CPU core) both models
# do not fit one 10-minute call: run MODELS=md3 and MODELS=md2 as two calls.
# Steps: environment (nvidia-smi, versions) -> full-size synthetic checkpoints written in the
# background on CPU cores (numpy; JAX kept off the GPU) -> with PEER=1, Kestrel's harness
# (.peer/run_device.sh) on the GPU meanwhile -> per model tools/benchmark.py (cold compile cache),
# then a second process for the warm-cache start-up -> ours / Kestrel ratio table.
# Every step has a time cap derived from DEADLINE_S; what does not fit is skipped and says so.
#
# Knobs: MODELS ("md3 md2"), PEER (0), DEADLINE_S (560: the whole script; a call allows 600),
#   OUT (/tmp/kjx_out), WORK (/tmp/kjx_bench: checkpoints are reused from here), PY (python3), BENCH_ARGS (extra
#   tools/benchmark.py options), PEER_BENCH_ARGS (extra bench_kestrel.py options),
#   PEER_REF (stored Kestrel results used when no side-by-side run exists), OVERLAP (1: Kestrel runs
#   while our checkpoints are written on other CPU cores; 0: after, which costs minutes).
# What comes back under $OUT (8 files at most): gpu_run.log, md3.json, md2.json, ratios.json,
#   traces.tar.gz (when under 15 MiB), peer/peer.log, peer/md3.json, peer/md2.json.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
T0=$(date +%s)
MODELS=${MODELS:-"md3 md2"}
PEER=${PEER:-0}
DEADLINE_S=${DEADLINE_S:-560}
OUT=${OUT:-/tmp/kjx_out}
WORK=${WORK:-/tmp/kjx_bench}
PY=${PY:-python3}
BENCH_ARGS=${BENCH_ARGS:-}
PEER_REF=${PEER_REF:-.peer/results/h200_kestrel-0.4.2.json}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
rm -rf "$WORK/traces"  # checkpoints are reused on a machine kept warm; traces and caches are not
exec > >(tee -a "$OUT/gpu_run.log") 2>&1

elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( DEADLINE_S - $(elapsed) )); }
say() { echo "== [$(elapsed)s] $*"; }

say "kestrel_jax GPU benchmark: MODELS='$MODELS' PEER=$PEER DEADLINE_S=$DEADLINE_S host $(hostname) $(date -u +%FT%TZ)"
git log -1 --format='commit %H %s' 2>/dev/null; git status --short 2>/dev/null | head -20
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
nvidia-smi
nproc; free -g | head -2; df -h /tmp | tail -1
$PY - <<'EOF'
import importlib.metadata as m
import jax
names = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "flax", "numpy", "ml-dtypes")
vs = {}
for n in names:
    try:
        vs[n] = m.version(n)
    except m.PackageNotFoundError:
        pass
print("versions", vs)
print("devices", jax.devices(), jax.devices()[0].device_kind)
EOF

# --- checkpoints: CPU-bound numpy writers, one process per model, started first so that they
# overlap the Kestrel run (they use 1 of 16 cores each and no GPU).
declare -A WPID
for M in $MODELS; do
  mkdir -p "$WORK/$M"
  JAX_PLATFORMS=cpu timeout -k 10 $(( DEADLINE_S - 60 )) nice -n 5 \
    $PY tools/benchmark.py --model "$M" --checkpoint "$WORK/$M" --prepare-only > "$WORK/write_$M.log" 2>&1 &
  WPID[$M]=$!
  say "checkpoint writer for $M started (pid ${WPID[$M]}) -> $WORK/$M"
done
writing() { kill -0 "${WPID[$1]}" 2>/dev/null && [ ! -f "$WORK/$1/tokenizer.json" ]; }  # written last

# --- Kestrel, same workload, same machine; meanwhile our writers run on other cores, unless OVERLAP=0
if [ "$PEER" = "1" ] && [ "${OVERLAP:-1}" = "0" ]; then
  for M in $MODELS; do while writing "$M"; do sleep 2; done; done; say "writers done (OVERLAP=0)"
fi
if [ "$PEER" = "1" ]; then
  if [ -d .peer/carry ] && [ -f .peer/run_device.sh ]; then
    PM=""
    for M in $MODELS; do case "$M" in md3) PM="$PM moondream3-preview" ;; md2) PM="$PM moondream2" ;; esac; done
    N=$(echo $PM | wc -w)
    PDL=$(( 120 + 130 * N ))  # its own deadline: pip install + per model synthesis, start-up, benchmark
    say "Kestrel peer: models$PM, deadline ${PDL}s"
    mkdir -p "$OUT/peer"
    # PYTHONPATH emptied: our checkout's top-level folders must not shadow anything Kestrel imports
    PYTHONPATH= OUT=$OUT/peer PEER_MODELS="${PM# }" PEER_DEADLINE_S=$PDL \
      PEER_BENCH_ARGS="${PEER_BENCH_ARGS:---requests-per-client 4 --reps 5 --stream-reps 2 --warmup 2}" \
      timeout -k 15 $(( PDL + 30 )) bash .peer/run_device.sh
    say "Kestrel peer exit $?"
    # fold its logs into one file (files that come back are limited to 8)
    (cd "$OUT/peer" && for f in env.log md3.log md2.log md3s.log; do
       [ -f "$f" ] && { echo "===== $f"; cat "$f"; rm -f "$f"; }; done) > "$WORK/peer.log"
    mv "$WORK/peer.log" "$OUT/peer/peer.log"
  else
    say "PEER=1 but .peer/carry or .peer/run_device.sh is missing: no Kestrel run (see ../shared/peer/README.md)"
  fi
fi

# --- ours, one model after the other (the GPU is ours alone from here on); a model whose checkpoint
# is ready goes first, so the GPU does not idle while a slower writer finishes.
ORDER=""
for M in $MODELS; do writing "$M" || ORDER="$ORDER $M"; done
for M in $MODELS; do case " $ORDER " in *" $M "*) ;; *) ORDER="$ORDER $M" ;; esac; done
N_LEFT=$(echo $ORDER | wc -w)
for M in $ORDER; do
  wait "${WPID[$M]}"; say "checkpoint writer $M exit $?"; tail -2 "$WORK/write_$M.log"
  BUSY=""; for R in $MODELS; do writing "$R" && BUSY="$BUSY $R"; done
  SHARE=$(( ( $(left) - 25 ) / N_LEFT )); N_LEFT=$(( N_LEFT - 1 ))
  if [ "$M" = "md3" ]; then WARM=80; else WARM=60; fi  # second process: load + compile-cache hits
  BUDGET=$(( SHARE - WARM - 30 ))
  if [ ! -f "$WORK/$M/config.json" ]; then
    say "skip $M: no checkpoint (writer failed or ran out of time)"; continue
  fi
  if [ "$BUDGET" -lt 90 ]; then
    say "skip $M: only ${SHARE}s for it"; continue
  fi
  rm -rf "$WORK/jax_cache_$M"  # a cold start-up must start from an empty cache
  # recorded in the JSON: a checkpoint writer still running on another core during this benchmark
  export KJX_BENCH_NOTE=${BUSY:+"checkpoint writer running concurrently for:$BUSY"}
  say "$M benchmark: budget ${BUDGET}s (+${WARM}s warm start-up) ${KJX_BENCH_NOTE}"
  # C=64 first: it is the level compared with Kestrel, and a short budget cuts the last ones
  timeout -k 15 $(( BUDGET + 30 )) $PY tools/benchmark.py --model "$M" --checkpoint "$WORK/$M" \
    --compile-cache "$WORK/jax_cache_$M" --trace-dir "$WORK/traces/$M" --out "$OUT/$M.json" \
    --time-budget-s "$BUDGET" --concurrency 64 8 32 $BENCH_ARGS
  say "$M benchmark exit $?"
  L=$(left)
  if [ "$L" -gt $(( WARM + 25 )) ]; then
    say "$M warm-cache start-up (second process)"
    timeout -k 15 $(( WARM + 10 )) $PY tools/benchmark.py --model "$M" --checkpoint "$WORK/$M" \
      --compile-cache "$WORK/jax_cache_$M" --out "$OUT/$M.json" --append $BENCH_ARGS
    say "$M warm start-up exit $?"
  else
    say "skip $M warm start-up: ${L}s left"
  fi
done

# --- profiler traces, if they fit what comes back (else only the batch-1 windows, else none)
if [ -d "$WORK/traces" ]; then
  LIMIT=$(( 15 * 1024 * 1024 ))
  tar czf "$OUT/traces.tar.gz" -C "$WORK" traces
  if [ "$(stat -c %s "$OUT/traces.tar.gz")" -gt "$LIMIT" ]; then
    (cd "$WORK" && tar czf "$OUT/traces.tar.gz" traces/*/w1)
    say "all traces too big to come back: traces.tar.gz holds the batch-1 windows only"
  fi
  if [ "$(stat -c %s "$OUT/traces.tar.gz")" -gt "$LIMIT" ]; then
    rm -f "$OUT/traces.tar.gz"; say "traces too big to come back: dropped (summaries are in the JSONs)"
  fi
fi

# --- ours / Kestrel
REF=(); [ -f "$PEER_REF" ] && REF=(--ref "$PEER_REF")
OURS=(); PEERS=()
for M in md3 md2; do
  [ -f "$OUT/$M.json" ] && OURS+=("$OUT/$M.json")
  [ -f "$OUT/peer/$M.json" ] && PEERS+=("$OUT/peer/$M.json")
done
$PY tools/benchmark.py compare --ours "${OURS[@]}" --peer "${PEERS[@]}" "${REF[@]}" --out "$OUT/ratios.json"
say "done; files under $OUT:"
find "$OUT" -type f | sort
