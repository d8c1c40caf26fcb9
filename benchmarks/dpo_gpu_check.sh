#!/bin/bash
# Issue 36 on one GPU (docs/benchmarks.md, "Preference fine-tuning on a GPU"): the built-in preference
# task in bf16, then DPO on a local bf16 model directory and a preference jsonl of long pairs (one pair
# of up to 8192 tokens a row): LoRA (reference = adapters off) and a full fine-tune (reference computed
# once and stored; a second run reads it). From the repository root: bash benchmarks/dpo_gpu_check.sh
set -x
if [ -d .whl ]; then  # wheels a bare GPU image lacks (datasets, fire), downloaded beforehand
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name())"
python3 -m recipes.finetune_longctx --objective dpo --dpo_loss orpo --batch_size 2 --eval_every 50 --output_dir /tmp/orpo --report_to none 2>&1 | grep -v Warning | grep "step=50 \|step=100 \|step=200 \|accuracy\|throughput" | cut -c1-200
python3 benchmarks/local_model.py /tmp/model
python3 - <<'PY'
import json, random
rng = random.Random(0)
words = "the of and to a in is it you that he was for on are with as his they be at one have this from".split()
text = lambda n: " ".join(rng.choice(words) for _ in range(n))
with open("/tmp/pairs.jsonl", "w") as f:
    for i in range(48):
        f.write(json.dumps({"prompt": text(rng.randint(200, 650)), "chosen": " " + text(rng.randint(10, 80)),
                            "rejected": " " + text(rng.randint(10, 80))}) + "\n")
PY
common="--objective dpo --model_name /tmp/model --dataset /tmp/pairs.jsonl --context_length 8192 --max_steps 8 --log_every 2 --report_to none --data_cache_dir /tmp/cache"
python3 -m recipes.finetune_longctx $common --use_peft --lora_target_modules all-linear --lr 1e-4 --output_dir /tmp/lora 2>&1 | grep -v Warning
python3 -m recipes.finetune_longctx $common --lr 1e-5 --output_dir /tmp/full 2>&1 | grep -v Warning
python3 -m recipes.finetune_longctx $common --lr 1e-5 --max_steps 2 --output_dir /tmp/full2 2>&1 | grep -v Warning | grep "reference\|step="
python3 -m recipes.plan_memory --model_name /tmp/model --objective dpo --context_length 8192 --use_peft --lora_target_modules all-linear --num_gpus 1 2>&1 | grep "total\|attention"
python3 -m recipes.plan_memory --model_name /tmp/model --objective dpo --context_length 8192 --num_gpus 1 2>&1 | grep "total\|attention"
