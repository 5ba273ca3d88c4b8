# Session 25, call 7 (nvidia-h100-x2): the multi-device engine on two real GPUs, the CPU test's
# script (tests/serving/multi_device_run.py: tiny synthetic MD3, the same requests through an
# engine on both devices and through a one-device engine on device 1; outputs must match).
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi -L > $OUT/x/7_env.txt
timeout 200 python3 - > $OUT/x/7_multi_device.log 2>&1 <<'PY'
import subprocess, sys, tempfile, pathlib, json, numpy as np
from PIL import Image
from kestrel_jax.checkpoint.synthetic import write_synthetic_checkpoint
from kestrel_jax.models.config import tiny_config
d = pathlib.Path(tempfile.mkdtemp())
ck = write_synthetic_checkpoint(d / "ck", tiny_config("md3", vision_layers=2), seed=5)
rng = np.random.default_rng(1)
imgs = []
for i in range(2):
    p = d / f"{i}.png"; Image.fromarray(rng.integers(0, 255, (300, 300, 3), dtype=np.uint8)).save(p); imgs.append(str(p))
r = subprocess.run([sys.executable, "tests/serving/multi_device_run.py", str(ck), *imgs], capture_output=True, text=True, timeout=190)
print(r.returncode); print(r.stderr[-3000:])
line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
if line:
    out = json.loads(line[7:]); two, one = out["two"], out["one"]
    print("outputs equal:", two["outputs"] == one["outputs"], "cancelled:", two["cancelled"], one["cancelled"])
    print("devices:", json.dumps(two["devices"]), json.dumps(one["devices"]))
    print("max_requests", two["max_requests"], one["max_requests"])
PY
echo "($SECONDS s)"; grep -v "^$" $OUT/x/7_multi_device.log | grep -v "cuda_\|^WARNING\|^I0000\|^E0000" | tail -12 | cut -c1-400
cd $OUT && tar czf 7_all.tgz x && rm -rf x
