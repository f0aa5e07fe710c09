import json, sys, time, subprocess
from pathlib import Path
here = Path(__file__).resolve().parent
sys.path.insert(0, str(here))
import cute_prefill_spike as K
VARIANTS = {
    "v1": dict(tree=True, producer_fence=True, consumer_fence=False, heads_fast=True),
    "v1_cfence": dict(tree=True, producer_fence=False, consumer_fence=True, heads_fast=True),
    "v1_nofence": dict(tree=True, producer_fence=False, consumer_fence=False, heads_fast=True),
    "w3": dict(tree=True, producer_fence=True, consumer_fence=False, heads_fast=True, nwg=3),
    "w3_nofence": dict(tree=True, producer_fence=False, consumer_fence=False, heads_fast=True, nwg=3),
    "w3o": dict(tree=True, producer_fence=True, consumer_fence=False, heads_fast=True, nwg=3, overlap=True),
    "v1o": dict(tree=True, producer_fence=True, consumer_fence=False, heads_fast=True, overlap=True),
    "w3os": dict(tree=False, producer_fence=True, consumer_fence=False, heads_fast=True, nwg=3, overlap=True, producer_regs=24, consumer_regs=160),
    "w3s": dict(tree=False, producer_fence=True, consumer_fence=False, heads_fast=True, nwg=3),
    "v0": dict(tree=False, producer_fence=False, consumer_fence=True, heads_fast=False),
}
names = sys.argv[1:] or list(VARIANTS)
out = here / "cubin"
out.mkdir(exist_ok=True)
for f in out.glob("*"):
    f.unlink()
for name in names:
    cfg = VARIANTS[name]
    t = time.time()
    cubin = K.compile_cubin(cfg)
    (out / f"{name}.cubin").write_bytes(cubin.image)
    (out / f"{name}.json").write_text(json.dumps(dict(symbol=cubin.symbol, smem=K.smem_bytes(64 * cfg.get("nwg", 2)), threads=128 * (cfg.get("nwg", 2) + 1), bm=64 * cfg.get("nwg", 2), **cfg)))
    print(name, "compiled in %.1fs" % (time.time() - t), len(cubin.image))
