#!/usr/bin/env bash
# Session 8, second device call: served/offline with the load generator on CPUs of its own,
# warm/cold start after the import fixes, speculation in fp16 with the switch-off per stream,
# and where a verification step's GPU time goes.
set -u
R=/tmp/r; mkdir -p $R/img /tmp/bin /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/bin:$PATH
printf '#!/bin/sh\nexec python3 "$@"\n' > /tmp/bin/python
printf '#!/bin/sh\nexec python3 -m server "$@"\n' > /tmp/bin/gpt2-serve
printf '#!/bin/sh\nexec python3 -m server.bench.cli "$@"\n' > /tmp/bin/gpt2-bench
chmod +x /tmp/bin/*
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
lscpu > $R/lscpu.txt; lscpu -p=CPU,CORE,SOCKET > $R/lscpu_p.txt
# the load generator on whole physical cores of their own: the upper half of the core ids
CLIENT=$(python3 -c "
rows=[l.split(',') for l in open('$R/lscpu_p.txt') if not l.startswith('#')]
cores=sorted({int(r[1]) for r in rows}); half=set(cores[len(cores)//2:])
print(','.join(r[0] for r in rows if int(r[1]) in half))")
echo "client cpus: $CLIENT" | tee $R/client_cpus.txt
OUT=$R MODELS=gpt2 SERVE_ARGS="--api-server-counts 1,2 --repeats 3 --num-workers 6 --client-cpus $CLIENT --sweep-rates inf --sweep-prompts 100" timeout 240 bash scripts/gpu_bench.sh serve > $R/serve_stage.log 2>&1
el serve; pack
MODEL=gpt2 OUT=$R/img RATES=inf NUM_PROMPTS=200 timeout 150 bash scripts/image_style_run.sh > $R/img_gpt2.log 2>&1
el img_gpt2; pack
OUT=$R SPEC_MODEL=gpt2-xl SPEC_ARGS="--rates 0,0.7,1.0 --ks 4 --batches 1,128 --output-len 64" timeout 150 bash scripts/gpu_bench.sh spec > $R/spec_stage.log 2>&1
el spec; pack
timeout 80 python3 - > $R/verify_profile.txt 2>&1 <<'PY'
import sys, time, torch
sys.path.insert(0, "scripts")
from bench_spec import parse_args
from spec_bench_engine import Bench, random_tokens
import random
args = parse_args(["--model", "gpt2-xl", "--batches", "1", "--ks", "4", "--output-len", "64"])
bench = Bench(args); rng = random.Random(0); prompt = random_tokens(rng, 128)
bench.configure(0); out, _ = bench.run([prompt]); ref = out[0].token_ids
for name, k in (("plain", 0), ("verify k=4 a=1", 4)):
    bench.configure(k)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out, sec = bench.run([prompt], [ref] if k else None, 1.0)
    print(f"== {name}: {sec*1e3:.1f} ms for {len(out[0].token_ids)} tokens")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70))
PY
el profile; pack
MODEL=gpt2-xl OUT=$R/img RATES=inf NUM_PROMPTS=100 timeout $(( 585 - ($(date +%s) - T0) )) bash scripts/image_style_run.sh > $R/img_gpt2-xl.log 2>&1
el img_xl; pack
