#!/usr/bin/env bash
# One device session on a lent GPU machine (run from the repo root, after `source .whl/unpack`):
# probe, GPU tests, batteries, decode benchmarks. Every phase has a timeout; logs and JSON land in $OUT.
# Pick phases with PHASES="probe tests battery1 battery2 battery4 host bench hfmap sat ttft2 bench4 engine kernels
# publish prefill prefillstep pgraphstep pgraphe2e kkt chunkcfg chunkh mixedstep e2e cudnn varlen varlen-e2e chunks budget moestep moekern moeblock l2 smem moe" (one run call is 10 minutes: split them over calls).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
phase() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T), limit ${limit}s)"; \
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; echo "=== $name rc=$rc"; tail -n 25 "$OUT/$name.log"; }
nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -5
python3 -c "import torch, ray, fla, transformers; print(torch.__version__, ray.__version__, transformers.__version__, torch.cuda.device_count())"
python3 -m memra_pp.cli make-tiny ~/.cache/memra_pp/tiny-qwen3_5-vision --vision >/dev/null
python3 - <<'PY'
import json, pathlib
p = pathlib.Path("~/.cache/memra_pp/tiny-qwen3_5-vision/config.json").expanduser()
print("tiny vision checkpoint:", p.exists())
PY
for phase_name in ${PHASES:-probe tests battery1 battery2 host}; do
  case $phase_name in
    probe) phase probe 200 python3 -u -m memra_pp.gpu_checks --out "$OUT" --handoffs 2000 ;;
    # the whole GPU suite took 492 s in the ninth session: TESTS="tests/test_gpu_a.py tests/test_gpu_b.py" runs a part
    tests) phase tests ${TESTS_S:-330} python3 -m pytest -q -m gpu -p no:cacheprovider --durations=12 ${TESTS:-tests/} ;;
    battery1) phase battery-one-card ${B1_S:-420} python3 -m memra_pp.cli battery cluster_configs/2xh200-one-card.yaml --out "$OUT/battery-one-card.json" ;;
    battery2) phase battery-2xh200 ${B2_S:-420} python3 -m memra_pp.cli battery cluster_configs/battery-2xh200.yaml --out "$OUT/battery-2xh200.json" ;;
    battery4) phase battery-4gpu 420 python3 -m memra_pp.cli battery cluster_configs/battery-4gpu.yaml --out "$OUT/battery-4gpu.json" ;;
    bench) phase gpu-decode 560 python3 -u benchmarks/gpu_decode.py --out "$OUT" --layouts "0;0,1" --concurrency 1,64,256 --new 64 --hf --hf-first --ttft 8192 ;;
    # nvidia-h200-x2, issue 7: transformers on one GPU and with device_map over both (the naive pipeline)
    hfmap) phase gpu-decode-hfmap 560 python3 -u benchmarks/gpu_decode.py --out "$OUT/hfmap" --layouts "" --concurrency 1,64 --new 64 --hf --hf-device-map 0,1 ;;
    # nvidia-h200-x2, issue 7 targets 1 (two stages), 2 (saturation: 512 in, 256 out, up to 1024 requests),
    # 4 (8k prompt, chunks pipelined across stages) and 5 (busy, handoffs): one phase per call
    sat) phase gpu-decode-sat 560 python3 -u benchmarks/gpu_decode.py --out "$OUT" --layouts "${SAT_LAYOUTS:-0;0,1}" --concurrency ${SAT_C:-64,256,384,512,1024} --prompt-len 512 --new 256 --deploy-each ;;
    # target 4 on two GPUs: one stage, then two stages with the prompt in whole chunks (1), in auto's 8 pieces, in 16
    ttft2) phase gpu-ttft-2 560 python3 -u benchmarks/gpu_decode.py --out "$OUT/ttft" --layouts "0;0,1" --concurrency 1 --new 64 --ttft 8192 --prefill-chunk ${TTFT_CHUNK:-4096} --pipeline-chunks ${TTFT_PIECES:-1,auto,16} ;;
    bench4) phase gpu-decode-4 560 python3 -u benchmarks/gpu_decode.py --out "$OUT" --layouts "0;0,1;0,1,2,3" --concurrency 64,256 ;;
    engine) phase gpu-engine-step ${ENGINE_S:-200} python3 -u benchmarks/gpu_engine_step.py --out "$OUT" --batches 1,64,256 --modes graph --profile ;;
    # issue 7 on the 35B-A3B MoE dimensions: the engine step (profiled) and the deployment against transformers
    # (--profile also writes each profiled step's critical path: profile-*.txt and critical_path.png)
    moestep) phase gpu-moe-step ${ENGINE_S:-200} python3 -u benchmarks/gpu_engine_step.py --out "$OUT/moe" --model preset:qwen3.5-35b-a3b --batches ${MOE_B:-1,64,256} --modes ${MOE_MODES:-graph,graph-torchmoe} --profile ;;
    # the prefill step as it is, as the twenty-third session left it (s23: without the merged path) and with the torch
    # ops and repeated heads, interleaved, then profiled; both models (~4 minutes)
    prefillstep) phase prefill-step-27b 240 python3 -u benchmarks/gpu_engine_step.py --out "$OUT/prefill27" --batches 1 \
                   --modes graph --iters 3 --prefill 1x4096,8x512 --prefill-torch --profile ;
                 phase prefill-step-moe 240 python3 -u benchmarks/gpu_engine_step.py --out "$OUT/prefillmoe" \
                   --model preset:qwen3.5-35b-a3b --batches 1 --modes graph --iters 3 --prefill 1x4096,8x512 \
                   --prefill-torch --profile ;;
    # mixed steps as the scheduler cuts them in the prefill ramp of target 2's workload (8 prompts of 512 beside the
    # decode rows of requests at 600 tokens): this session's kernels against s23 (no merged path, decode rows as
    # groups) and the torch ops, interleaved, with a profile of each
    mixedstep) phase mixed-step-27b 240 python3 -u benchmarks/gpu_engine_step.py --out "$OUT/mixed27" --batches 1 \
                 --modes graph --iters 3 --ctx 600 --prefill 8x512+56,8x512+248 --prefill-torch --profile --profile-first ;
               phase mixed-step-moe 240 python3 -u benchmarks/gpu_engine_step.py --out "$OUT/mixedmoe" \
                 --model preset:qwen3.5-35b-a3b --batches 1 --modes graph --iters 3 --ctx 600 \
                 --prefill 8x512+56,8x512+504 --prefill-torch --profile --profile-first ;;
    # end to end, target 2's workload at two levels, the prefill's merged path off then on (one deployment each);
    # E2E_MODEL=preset:qwen3.5-35b-a3b E2E_C=64,512 for the MoE
    e2e) phase gpu-decode-e2e 560 python3 -u benchmarks/gpu_decode.py --out "$OUT/e2e" --model ${E2E_MODEL:-preset:qwen3.5-27b} \
           --layouts 0 --concurrency ${E2E_C:-64,256} --prompt-len 512 --new 256 --prefill-merged both ;;
    # the same workload with prompt lengths spread (256-768: every prefill step a new mix of shapes), SDPA's own
    # backend choice (cuDNN, which plans each new shape) against attention.sdpa's (flash), one deployment each
    cudnn) phase gpu-decode-cudnn 560 python3 -u benchmarks/gpu_decode.py --out "$OUT/cudnn" \
             --model ${E2E_MODEL:-preset:qwen3.5-35b-a3b} --layouts 0 --concurrency ${E2E_C:-64,512} --prompt-len 512 \
             --prompt-spread 0.5 --new 256 --sdpa-cudnn both ;;
    # a prefill step of prompts of spread lengths (traffic's: every step a new mix), the Gated DeltaNet's segments by
    # groups of equal lengths against one variable-length call (MEMRA_PP_PREFILL_VARLEN), interleaved; then end to
    # end, the spread workload without and with it (VARLEN_MODEL / VARLEN_C for the other model and levels)
    # (MEMRA_PP_PREFILL_VARLEN=1 so that the load's warm-up compiles and tunes the variable-length call as a
    # deployment with it on would; the groups way turns it off for its steps)
    varlen) MEMRA_PP_PREFILL_VARLEN=1 phase fla-host 200 sh -c "python3 -u benchmarks/fla_host.py --out $OUT/flahost --cprofile && \
              python3 -u benchmarks/fla_host.py --out $OUT/flahost27 --model preset:qwen3.5-27b" ;
            MEMRA_PP_PREFILL_VARLEN=1 phase varlen-step-27b 240 python3 -u benchmarks/gpu_engine_step.py --out "$OUT/varlen27" --batches 1 \
              --modes graph --iters 3 --ctx 600 --prefill 8x512~0.5+56,8x512+56,16x256~0.75 --prefill-varlen \
              --profile --profile-first ;
            MEMRA_PP_PREFILL_VARLEN=1 phase varlen-step-moe 240 python3 -u benchmarks/gpu_engine_step.py --out "$OUT/varlenmoe" \
              --model preset:qwen3.5-35b-a3b --batches 1 --modes graph --iters 3 --ctx 600 \
              --prefill 8x512~0.5+56,8x512+56,16x256~0.75 --prefill-varlen --profile --profile-first ;;
    varlen-e2e) phase varlen-e2e 560 python3 -u benchmarks/gpu_decode.py --out "$OUT/varlene2e" \
                  --model ${VARLEN_MODEL:-preset:qwen3.5-35b-a3b} --layouts 0 --concurrency ${VARLEN_C:-64,512} \
                  --prompt-len 512 --prompt-spread 0.5 --new 256 --prefill-varlen both ;;
    # the spread workload with larger prefill steps (one deployment per prefill_chunk): since the variable-length
    # calls a step's host time no longer grows with its mix of lengths, and the MoE's expert GEMMs get more rows
    chunks) phase gpu-decode-chunks 560 python3 -u benchmarks/gpu_decode.py --out "$OUT/chunks" \
              --model ${E2E_MODEL:-preset:qwen3.5-35b-a3b} --layouts 0 --concurrency ${E2E_C:-512} --prompt-len 512 \
              --prompt-spread 0.5 --new 256 --prefill-chunk ${CHUNKS:-4096,8192,16384} ;;
    # a smaller prompt budget while requests decode (scheduler.prefill_chunk_decoding), one deployment per value:
    # what it buys the decoding requests' inter-token latency and costs the first tokens and the rate
    budget) phase gpu-decode-budget 560 python3 -u benchmarks/gpu_decode.py --out "$OUT/budget" \
              --model ${E2E_MODEL:-preset:qwen3.5-27b} --layouts 0 --concurrency ${E2E_C:-64} --prompt-len 512 \
              --prompt-spread 0.5 --new 256 --prefill-chunk ${CHUNKS:-4096} --prefill-chunk-decoding ${PDS:-off,1024} \
              --gc-freeze ${GCF:-on} ;;
    # prompt steps eagerly (kernels) and through the prefill graphs (graphs), interleaved, on the 35B-A3B (host-bound
    # prompt steps) then the 27B; PGS_SHAPES / PGS_MODELS pick others
    pgraphstep) for m in ${PGS_MODELS:-preset:qwen3.5-35b-a3b preset:qwen3.5-27b}; do
                  phase "pgraph-step-${m#preset:qwen3.5-}" ${PGS_S:-240} python3 -u benchmarks/gpu_engine_step.py \
                    --out "$OUT/pgraph-${m#preset:qwen3.5-}" --model $m --batches 1 --modes graph --iters 3 --ctx 600 \
                    --prefill ${PGS_SHAPES:-1x1024,1x4096,8x512~0.5,8x512~0.5+56} --prefill-graphs ; done ;;
    # end to end with and without the prefill graphs (one deployment each; PGE_GRAPHS=on|off|both), fla's rule through
    # the rule graphs or eager (PGE_RULES=off|on|both), the prompt budget PDS (off, or e.g. 1024)
    pgraphe2e) phase gpu-decode-pgraphs 560 python3 -u benchmarks/gpu_decode.py --out "$OUT/pgraphs" \
              --model ${E2E_MODEL:-preset:qwen3.5-35b-a3b} --layouts 0 --concurrency ${E2E_C:-64} --prompt-len 512 \
              --prompt-spread 0.5 --new 256 --prefill-chunk ${CHUNKS:-4096} --prefill-chunk-decoding ${PDS:-off} \
              --prefill-graphs ${PGE_GRAPHS:-both} --rule-graphs ${PGE_RULES:-off} ;;
    # fla's kkt-solve kernel alone over fresh inputs and the rule graphs' buffers, exact and padded layouts (why the
    # rule graphs' padded call takes ~13 us more of it a layer: docs/PERF.md, fortieth session), then every way
    # every tuned kernel of fla's chunked rule, each config pinned in turn, over a step's segment layouts, both models
    chunkcfg) for m in ${CC_MODELS:-preset:qwen3.5-35b-a3b preset:qwen3.5-27b}; do
                phase "chunk-configs-${m#preset:qwen3.5-}" ${CC_S:-240} python3 -u benchmarks/fla_host.py \
                  --out "$OUT/chunkcfg-${m#preset:qwen3.5-}" --model $m --checks-only \
                  --chunk-configs ${CC_LAYOUTS:-1x1024,1x4096,8x256,16x128} ; done ;;
    # prompt steps through the prefill graphs with fla's chunk_h pinned and chosen by its grid (MEMRA_PP_CHUNK_H_GRID),
    # interleaved, both models (~3 minutes each on an H100); then the sweep with the grid pick marked in use
    chunkh) for m in ${CH_MODELS:-preset:qwen3.5-27b preset:qwen3.5-35b-a3b}; do
              phase "chunkh-step-${m#preset:qwen3.5-}" ${CH_S:-270} python3 -u benchmarks/gpu_engine_step.py \
                --out "$OUT/chunkh-${m#preset:qwen3.5-}" --model $m --batches 1 --modes graph --iters 3 --ctx 600 \
                --prefill ${CH_SHAPES:-1x1024,1x4096,16x128~0.5,8x256~0.5} --prefill-graphs --chunk-h-grid ; done ;;
    kkt) phase kkt-probe 200 python3 -u benchmarks/fla_host.py --out "$OUT/kkt" --prompts 1x1024,8x256~0.5 --kkt-probe --kkt-grid ;;
    moekern) phase moe-kernels 200 python3 -u benchmarks/moe_kernels.py --out "$OUT/moe" ;;
    # the one-row MoE block as one persistent kernel (kernels/moe_block.py): alone against its three kernels, with
    # its phases stamped, then in the step both ways, interleaved (BLOCK_CONFIGS / BLOCK_MODES: other tiles and
    # register caps, e.g. 4x4x4x2x0r168 / graph-sample-block-reg168; the fifteenth session's lower-register tries
    # were all slower alone: docs/PERF.md)
    moeblock) phase moe-block 150 python3 -u benchmarks/moe_block_bench.py --out "$OUT/moe" --spins asm \
                ${BLOCK_CONFIGS:+--configs $BLOCK_CONFIGS} ;
              phase moe-block-step 240 python3 -u benchmarks/gpu_engine_step.py --out "$OUT/moe" \
                --model preset:qwen3.5-35b-a3b --batches 1 \
                --modes ${BLOCK_MODES:-graph-sample-noblock,graph-sample-block,graph-sample-noblock,graph-sample-block} ;;
    # is an L2-resident input projection faster, and does a side stream that prefetches it during a latency window
    # pay (docs/PERF.md, sixteenth session: not shown faster; its timing has caveats, smem's L2 rows re-ask it)
    l2) phase l2-prefetch 200 python3 -u benchmarks/l2_prefetch_bench.py --out "$OUT/l2" ;;
    # the megakernel's premise: a weight loaded into shared memory or registers during a latency window (grid
    # barriers in one persistent CUDA kernel, NVRTC-compiled), against reading it after, with L2 emptied by a read
    # and by a write (docs/PERF.md, sixteenth session)
    smem) phase smem-preload 150 python3 -u benchmarks/smem_preload_bench.py --out "$OUT/smem" ;
          phase smem-preload-write 150 python3 -u benchmarks/smem_preload_bench.py --out "$OUT/smem-write" --flush write ;;
    moe) phase gpu-moe-decode 560 python3 -u benchmarks/gpu_decode.py --out "$OUT/moe" --model preset:qwen3.5-35b-a3b --layouts "${MOE_LAYOUTS:-0}" --concurrency ${MOE_C:-1,64,256} --new 64 ${MOE_HF:-} ;;
    kernels) phase gpu-kernels 120 python3 -u benchmarks/gpu_kernels.py --out "$OUT" ;;
    publish) phase overlay-publish 200 python3 -u benchmarks/overlay_publish.py --tower cuda:0 --intake cuda:${PUB_INTAKE:-1} --json "$OUT/overlay_publish.json" ;;
    prefill) phase prefill-pipeline 300 python3 -u benchmarks/prefill_pipeline.py --device cuda --model preset:qwen3.5-27b --prompt 8192 --chunk 1024 --json "$OUT/prefill_pipeline.json" ;;
    host) phase battery-host ${HOST_S:-300} python3 -m memra_pp.cli battery cluster_configs/host-bounce.yaml --out "$OUT/battery-host.json" ;;
  esac
done
