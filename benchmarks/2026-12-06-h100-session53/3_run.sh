# Prepared in session 52 (2026-12-06), run in session 53 (any H100 or H200).
# The LayerNorm inside the rows kernel, x tiles formed step
# by step in the K loop: KESTREL_JAX_LN_IN_ROWS=1 (MD3's MoE layers) and KESTREL_JAX_DENSE_LN_IN_ROWS=1
# (dense layers over their joined QKV + fc1 weight). Session 52's call 2 (H100), with the LayerNorm's
# loads after the weight ring's fill: MD3 step -0.5% (rows kernel 11.39 -> 12.81 us, the 1.70 us
# LayerNorm launch gone), MD2 step -0.2%. Since then x, scale and bias load before the fill. Kernel
# checks (MoE pair, dense joined product), probes (MD3, MD2), then W1 B A B A (each run its own
# process and compile cache) for whichever model's best set is >= 0.5% under its default. Outputs are
# kept in /tmp/x and tarred into $OUT after each stage (session 52's call ran out of device time
# before its one tar at the end, and the device tool returns neither file names with "=" nor more
# than a few loose files).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
X=/tmp/x; rm -rf $X; mkdir -p $X
save() { tar czf $OUT/3_all.tgz -C /tmp x; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $X/3_env.txt
check() {
  timeout 80 python3 tools/check_ln_in_rows.py --draws 4 $([ $1 = dense ] && echo --dense) \
    --out $X/3_kernel_check_$1.json 2>&1 | grep -v "$FILT" > $X/3_kernel_check_$1.log
  echo "kernel check $1 ($SECONDS s): $(grep -c '"products_equal": true' $X/3_kernel_check_$1.log) ok"
  grep -i "false\|rror" $X/3_kernel_check_$1.log | head -3 | cut -c1-250; save
}
check dense
timeout 120 python3 tools/probe_step_kernels.py --kernels 45 --top 30 --model md2 --kinds decode --batch 1 \
  --sets default KESTREL_JAX_DENSE_LN_IN_ROWS=1 --json $X/3_probe_md2.json 2>&1 \
  | grep -v "$FILT" > $X/3_probe_md2.log
echo "probe md2 ($SECONDS s):"; grep "^\[.*\] decode:\|rror\|gemv_rows\|layer_norm_rows\|gemm_fusion" $X/3_probe_md2.log | cut -c1-150; save
check moe
timeout 170 python3 tools/probe_step_kernels.py --kernels 45 --top 30 --model md3 --kinds decode --batch 1 \
  --sets default KESTREL_JAX_LN_IN_ROWS=1 KESTREL_JAX_LN_IN_ROWS=1+KESTREL_JAX_DENSE_LN_IN_ROWS=1 \
  --json $X/3_probe_md3.json 2>&1 | grep -v "$FILT" > $X/3_probe_md3.log
echo "probe md3 ($SECONDS s):"; grep "^\[.*\] decode:\|rror\|gemv_rows\|layer_norm_rows\|gemm_fusion" $X/3_probe_md3.log | cut -c1-150; save
best() { python3 - $1 <<'PY'
import re, sys
t = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\[(.*)\] decode: ([0-9.]+) us", open(sys.argv[1]).read(), re.M)}
best = min(t, key=t.get) if t else "default"
gain = 1 - t[best] / t["default"] if t and "default" in t else 0
print(f"{gain:.4f} {best}" if best != "default" and gain >= 0.005 else "")
PY
}
B3=$(best $X/3_probe_md3.log); B2=$(best $X/3_probe_md2.log)
echo "best md3: '$B3' md2: '$B2'"
# the W1 pair for the model with the larger gain
M=md3; BEST=${B3#* }; G3=${B3%% *}; G2=${B2%% *}
[ -n "$B2" ] && { [ -z "$B3" ] || python3 -c "import sys; sys.exit(0 if $G2 > $G3 else 1)"; } && { M=md2; BEST=${B2#* }; }
[ -z "$B3$B2" ] && exit 0
ARGS="--engine-args decode_buckets=1,64 prefill_token_buckets=768,1536,2048,3072 runner.vision_buckets=1"
for run in B1 A1 B2 A2; do  # ~120 s a run (session 52: the probes took 23-37 s each)
  v=${run:0:1}
  [ $SECONDS -gt 440 ] && { echo "skip W1 $run: $SECONDS s"; continue; }
  ENV="KESTREL_JAX_UNUSED=0"; [ $v = B ] && ENV=$(echo "$BEST" | tr '+' ' ')
  env $ENV timeout $((580 - SECONDS)) python3 tools/benchmark.py --model $M --random-weights \
    --compile-cache /tmp/cc_${M}_$run --workloads w1 $ARGS --out $X/3_${M}_w1_$run.json 2>&1 \
    | grep -v "$FILT" > $X/3_${M}_w1_$run.log
  echo "$M W1 $run [$ENV] ($SECONDS s): $(grep "w1:\|rror" $X/3_${M}_w1_$run.log | cut -c1-150 | tr '\n' ' ')"; save
done
