"""Issue 45 probe (run as is on one H200 at ea4ac2c): the serving scenario's phases timed at h200-21k b128. python scripts/gpu_serving_phases.py OUT_DIR"""
# where the serving scenario's time goes at h200-21k b128: phases timed, printed as they end
import sys, time
t00 = time.perf_counter()
def say(*a): print(f"[{time.perf_counter() - t00:7.1f}s]", *a, flush=True)
import torch
from pathlib import Path
from freescale.config import build_config
from freescale.data.source import schema_of
from freescale.pipeline.setup import build_model, make_source
from freescale.serving import export_model, load
from freescale.serving.aoti import compile_package
out = Path(sys.argv[1]); dev = torch.device("cuda")
cfg = build_config("h200-21k", []); source = make_source(cfg)
torch.manual_seed(0)
model = build_model(cfg.model, schema_of(source)).to(dev).eval(); say("model")
batches = [source.batch(s, 0, 1, 128).to(dev) for s in range(6)]; say("6 batches", batches[0])
with torch.no_grad():
    for b in batches[:2]: model(b)
    torch.cuda.synchronize(); t = time.perf_counter(); model(batches[2]); torch.cuda.synchronize(); say("eager ms", (time.perf_counter() - t) * 1e3)
export_model(model, batches[0], out, device="cuda", aoti=False, attention="jagged"); say("torch.export done")
served = load(out, aoti=False)
with torch.no_grad():
    for b in batches[:2]: served(b)
    torch.cuda.synchronize(); t = time.perf_counter(); served(batches[2]); torch.cuda.synchronize(); say("exported program ms", (time.perf_counter() - t) * 1e3)
    say("max diff", max((served(b) - model(b)).abs().max().item() for b in batches[3:]))
print(compile_package(out / "model.pt2", out / "model_aoti.pt2")); say("aoti compiled")
aoti = load(out)
with torch.no_grad():
    for b in batches[:2]: aoti(b)
    ts = []
    for b in batches[2:]:
        torch.cuda.synchronize(); t = time.perf_counter(); aoti(b); torch.cuda.synchronize(); ts.append((time.perf_counter() - t) * 1e3)
    say("aoti ms", ts, "kind", aoti.kind)
    say("max diff", max((aoti(b) - model(b)).abs().max().item() for b in batches[2:]))
