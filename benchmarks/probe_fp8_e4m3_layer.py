"""Probe: fp8 activations on e4m3 fragments against the bf16 path (issue 23), graph-timed over 4
layers, with pinned configs, and the e4m3 outputs against the reference (fp8 tolerance).

    CASES=benchmarks/probe_fp8_e4m3_cases.py bash scripts/run_from_source.sh \
        python3 benchmarks/probe_fp8_e4m3_layer.py
"""
import os, sys, statistics
sys.path.insert(0, "benchmarks")
import torch
import bench_moe as b
from tokenspeed_kernel import MoEConfig, moe_plan, moe_prepare_weights, moe_apply
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.testing.compare import compare
from tokenspeed_kernel_triton.moe.fragment_config_sm90 import FragmentConfig as F

layers = 4
ns = dict(F=F)
exec(open(os.environ["CASES"]).read(), ns)
CASES, CHECK = ns["CASES"], ns.get("CHECK", ())
if CHECK:
    w = b.checkpoint_weights()
    ref = get_kernel("moe_apply", "reference.moe_apply")
    for static in (True, False):
        ws = w
        if static:
            import dataclasses
            ws = dataclasses.replace(w, w13_input_scale=3.5 / 448, w2_input_scale=24.0 / 448)
        cfg = MoEConfig(b.E, b.TOP_K, b.H, b.I, weight_format="mxfp4", activation_format="fp8")
        plan = moe_plan(cfg, device="cuda", max_num_tokens=8192)
        prep = moe_prepare_weights(plan, ws)
        from tokenspeed_kernel.testing.conformance import moe_plan_for
        rplan = moe_plan_for(ref, cfg, 8192, "cuda")
        rprep = ref.fn.prepare_weights(rplan, ws)
        print("decode", prep.tensors["w13_decode"], prep.tensors["w2_decode"], flush=True)
        for m in CHECK:
            x, logits, out = b.token_inputs(m)
            moe_apply(plan, x, prep, router_logits=logits, out=out)
            exp = torch.empty_like(x)
            ref.fn.apply(rplan, x, rprep, router_logits=logits, out=exp)
            print(f"static={static} M={m}", compare(out, exp, dtype=torch.float8_e4m3fn, name="out"), flush=True)
        del prep, rprep
    del w
torch.cuda.empty_cache()
bf, bf_scales = b.gpt_oss_tensors(False, "fragment")
V = {"bf16": (b.weight_copies(bf, layers), "bf16", bf_scales)}
del bf
for static in (True, False):
    p, sc = b.gpt_oss_tensors(static, "fragment", e4m3=True)
    assert p["w2_decode"] == "e4m3", p["w2_decode"]
    V[f"e4m3 {'static' if static else 'dynamic'}"] = (b.weight_copies(p, layers), "fp8", sc)
reps = int(os.environ.get("REPS", "2"))
for m, configs in CASES.items():
    res = {}
    for r in range(reps):
        for label, (lay, act, sc) in V.items():
            cs = [None] if label == "bf16" else configs
            for i, c in enumerate(cs):
                us, _ = b.run_case(lay, m, act, sc, graph=True, config=c)
                res.setdefault((label, i), []).append(us)
    base = statistics.median(res[("bf16", 0)])
    print(f"M={m} bf16 pick {base:.1f}", flush=True)
    for (label, i), t in res.items():
        if label == "bf16":
            continue
        c = configs[i]
        print(f"  {label} {c if c is not None else 'pick'}: {statistics.median(t):.1f} [{min(t):.1f}-{max(t):.1f}]  bf16/this {base / statistics.median(t):.2f}", flush=True)
