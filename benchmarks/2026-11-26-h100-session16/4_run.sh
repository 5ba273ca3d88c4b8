# Session 16, call 4: is the two-level batch-1 state host placement? The PJRT threads that launch
# each step's command buffers and kernels could land on CPUs near or far from the GPU after the
# compile threads of a load. The process is pinned to the GPU's local CPUs (sysfs local_cpulist;
# the first 8 of them when that is every CPU) and runs call 2's stages (2,4 / 6,12 / 24, run),
# where the 6,12 stage switched three processes of three to the slow level.
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
EA="decode_buckets=1 mixed_decode_buckets=64 prefill_token_buckets=1024 runner.vision_buckets=1 runner.vision_image_batches=()"
BUS=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f' | sed 's/^0000//')
LOCAL=$(cat /sys/bus/pci/devices/$BUS/local_cpulist 2>/dev/null || echo "")
{ echo "bus $BUS local_cpulist '$LOCAL' nproc $(nproc)"; lscpu | grep -i "numa\|socket\|core\|model name\|^CPU(s)"; nvidia-smi topo -m; } > $OUT/4_topo.txt 2>&1
CPUS=$LOCAL
if [ -z "$CPUS" ] || [ "$(taskset -c -p $$ | sed 's/.*: //')" = "$CPUS" ]; then CPUS=0-7; fi
echo "pinned to $CPUS" | tee -a $OUT/4_topo.txt
timeout 200 taskset -c $CPUS python3 tools/probe_loaded_modules.py --compile-cache /tmp/cc6 --decode-buckets 2,4 6,12 24 \
  --xla --mosaic --engine-args $EA --out $OUT/4_probe_pinned.json 2>&1 | grep -v "$FILT" > $OUT/4_probe_pinned.log
grep -h "stage {\|rror\|ready" $OUT/4_probe_pinned.log | cut -c18-200; head -30 $OUT/4_topo.txt
