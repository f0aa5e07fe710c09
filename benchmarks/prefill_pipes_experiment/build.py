import json, sys, time
from pathlib import Path
here = Path(__file__).resolve().parent
sys.path.insert(0, str(here))
sys.path.insert(0, str(here))
import prefill_persist as P
import prefill_sm90 as K
import prefill_fast as F
import prefill_aug as A
import prefill_augs as AS
VARIANTS = {
    "w3s": (K, dict(tree=False, producer_fence=True, consumer_fence=False, heads_fast=True, nwg=3)),
    "p3": (P, dict(tree=False, nwg=3, persistent=True)),
    "p3t": (P, dict(tree=True, nwg=3, persistent=True)),
    "f3": (F, dict(tree=False, nwg=3)),
    "f3_noscale": (F, dict(tree=False, nwg=3, fprobe=("noscale",))),
    "f3_nosumwg": (F, dict(tree=False, nwg=3, fprobe=("nosumwg",))),
    "f3_noboth": (F, dict(tree=False, nwg=3, fprobe=("noscale", "nosumwg"))),
    "a3": (A, dict(tree=False, nwg=3)),
    "as3": (AS, dict(tree=False, nwg=3)),
    "as3o": (AS, dict(tree=False, nwg=3, ovl=True)),
    "as3_branch": (AS, dict(tree=False, nwg=3, aug_always=False)),
    "a3_noscale": (A, dict(tree=False, nwg=3, fprobe=("noscale",))),
    "a3o": (A, dict(tree=False, nwg=3, ovl=True)),
    "a3o_noscale": (A, dict(tree=False, nwg=3, ovl=True, fprobe=("noscale",))),
    "a3_branch": (A, dict(tree=False, nwg=3, aug_always=False)),
    "f3_eager": (F, dict(tree=False, nwg=3, lazy=False)),
    "w3s_nosum": (K, dict(tree=False, nwg=3, probe=("nosum",))),
    "w3s_noffma": (K, dict(tree=False, nwg=3, probe=("noffma",))),
    "w3s_norescale": (K, dict(tree=False, nwg=3, probe=("norescale",))),
    "w3s_nomax": (K, dict(tree=False, nwg=3, probe=("nomax",))),
    "w3s_noall": (K, dict(tree=False, nwg=3, probe=("nosum", "noffma", "norescale", "nomax"))),
    "w3s_sumffma": (K, dict(tree=False, nwg=3, probe=("nosum", "noffma"))),
}
names = sys.argv[1:] or list(VARIANTS)
out = here / "cubin"
out.mkdir(exist_ok=True)
for f in out.glob("*"):
    f.unlink()
for name in names:
    mod, cfg = VARIANTS[name]
    t = time.time()
    cubin = mod.compile_cubin(cfg)
    (out / f"{name}.cubin").write_bytes(cubin.image)
    nwg = cfg.get("nwg", 2)
    (out / f"{name}.json").write_text(json.dumps(dict(symbol=cubin.symbol, smem=mod.smem_bytes(64 * nwg), threads=128 * (nwg + 1), bm=64 * nwg, **dict(dict(heads_fast=True), **cfg))))
    print(name, "compiled in %.1fs" % (time.time() - t), len(cubin.image))
