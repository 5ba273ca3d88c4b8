import time, os, statistics, numpy as np, threading
from PIL import Image
from kestrel_jax.models import image_crops as ic
from kestrel_jax.models.config import md3_config
v = md3_config().vision
img = np.random.default_rng(0).integers(0, 255, (756, 756, 3), dtype=np.uint8)
def med(f, n=15):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(ts), 2)
print("cpus", os.cpu_count(), "sched_getaffinity", len(os.sched_getaffinity(0)))
try:
    print(open("/sys/fs/cgroup/cpu.max").read().strip())
except Exception as e:
    print("no cpu.max", e)
print("pil one call 756->910", med(lambda: ic._pil_resize(img, 910, 910)), "756->378", med(lambda: ic._pil_resize(img, 378, 378)))
print("rows only 756->910 wide", med(lambda: ic._pil_resize(img, 910, 756)), "cols only", med(lambda: ic._pil_resize(img, 756, 910)))
strip = img[:95]
print("one strip 95 rows", med(lambda: ic._pil_resize(strip, 910, 95)))
for n in (1, 2, 4, 8, 16):
    ic.IMAGE_THREADS = n
    ic._pool = None
    print(n, "threads: resize 910", med(lambda: ic.resize_lanczos(img, 910, 910, threads=n)),
          "crops", med(lambda: ic.overlap_crops(img, v)))
# raw thread scaling of PIL on independent full images
def work():
    ic._pil_resize(img, 910, 910)
for n in (1, 2, 4, 8, 16):
    ts = [threading.Thread(target=work) for _ in range(n)]
    t = time.perf_counter(); [x.start() for x in ts]; [x.join() for x in ts]
    print(n, "independent full resizes in parallel: ms", round((time.perf_counter() - t) * 1e3, 1))
