"""The bf16-autocast references of tiny-qwen2: what PyTorch computes for the checkpoint's first
input under `torch.autocast("cpu", dtype=torch.bfloat16)` (f32 weights, bf16 matmuls), the
way mixed-precision training runs it. Run from this folder, in a venv with torch and
transformers:

    python make_bf16.py

Writes `reference-bf16.safetensors`: `logits_0` [len, vocab] (f32) and `grad.<param name>` =
d nll_seq0 / d parameter (f32 master weights, as autocast leaves them), and
`reference-bf16.json`: `nll_seq0`, the versions used.
"""
import json

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ref = json.load(open("reference.json"))
ids = torch.tensor([ref["input_ids"][0]])
model = AutoModelForCausalLM.from_pretrained("checkpoint", dtype=torch.float32)
model.train()
with torch.autocast("cpu", dtype=torch.bfloat16):
    logits = model(input_ids=ids).logits
logp = torch.log_softmax(logits.float(), dim=-1)
nll = -logp[0, :-1].gather(-1, ids[0, 1:, None]).mean()
nll.backward()
out = {"logits_0": logits[0].detach().float().contiguous()}
for name, p in model.named_parameters():
    out[f"grad.{name}"] = p.grad.detach().float().contiguous()
save_file(out, "reference-bf16.safetensors")
json.dump(
    {
        "nll_seq0": nll.item(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "autocast": "cpu, bfloat16",
    },
    open("reference-bf16.json", "w"),
    indent=1,
)
