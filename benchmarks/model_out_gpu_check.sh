#!/bin/bash
# Issue 35 on one GPU (docs/benchmarks.md, "Model out on a GPU"): a local bf16 model directory and a jsonl
# file; the real-model defaults (activation checkpointing on, bf16), the bf16 export, --merge_lora,
# recipes.export and the perplexity eval. From the repository root: bash benchmarks/model_out_gpu_check.sh
# (the perplexity JSON and plot go to ${OUT:-/tmp/out}/ppl, default /tmp/out/ppl).
set -x
if [ -d .whl ]; then  # wheels a bare GPU image lacks (datasets, fire), downloaded beforehand
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name())"
python3 benchmarks/local_model.py /tmp/model
python3 - <<'PY'
import json, random
rng = random.Random(0)
words = "the of and to a in is it you that he was for on are with as his they be at one have this from".split()
with open("/tmp/data.jsonl", "w") as f:
    for i in range(64):
        f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(500, 3000)))}) + "\n")
PY
python3 -m recipes.finetune_longctx --model_name /tmp/model --dataset /tmp/data.jsonl --context_length 8192 --output_dir /tmp/full --report_to none --log_every 2 2>&1 | grep -v Warning
python3 -c "import json; c=json.load(open('/tmp/full/run_info.json'))['config']; print('resolved', c['optim']['lr'], c['max_steps'], c['save_every'], c['model']['activation_checkpointing'], c['model']['dtype'])"
ls -la /tmp/full/final /tmp/full/checkpoints
python3 -m recipes.finetune_longctx --model_name /tmp/model --dataset /tmp/data.jsonl --context_length 8192 --use_peft --lora_target_modules all-linear --merge_lora --max_steps 6 --output_dir /tmp/lora --report_to none --log_every 2 2>&1 | grep -v Warning
python3 -m recipes.export --checkpoint /tmp/lora --output_dir /tmp/lora_merged_offline --merge_lora
python3 -m recipes.eval_longctx --model_name /tmp/lora/final --task perplexity --dataset /tmp/data.jsonl --lengths 1024,2048 --num_samples 4 --output_dir ${OUT:-/tmp/out}/ppl
python3 - <<'PY'
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
full = load_file("/tmp/full/final/model.safetensors"); print("full final dtypes", {str(v.dtype) for v in full.values()})
ids = torch.randint(0, 256, (1, 512), generator=torch.Generator().manual_seed(0)).cuda()
a = AutoModelForCausalLM.from_pretrained("/tmp/lora/final_merged", dtype=torch.float32).cuda()
b = AutoModelForCausalLM.from_pretrained("/tmp/lora_merged_offline", dtype=torch.float32).cuda()
with torch.no_grad():
    print("merged at the end vs recipes.export of the checkpoint: max logit diff", (a(ids).logits - b(ids).logits).abs().max().item())
print("merged dtype on disk", {str(v.dtype) for v in load_file("/tmp/lora/final_merged/model.safetensors").values()})
PY
