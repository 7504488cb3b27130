"""Chat fixtures: what transformers' `apply_chat_template` renders and tokenizes, for three
tokenizer families, so the Rust chat template and tokenizer can be checked token for token.

For each family a folder holds a checkpoint's tokenizer files (`tokenizer.json`,
`tokenizer_config.json` with the family's chat template, bos and eos) and `cases.json`:
- `chats`: messages, `add_generation_prompt`, the rendered `text` and the `ids` of
  `apply_chat_template(messages, tokenize=True)` (no special tokens added: the template has them);
- `answers`: an SFT answer's text and `tokenizer(text, add_special_tokens=False)` ids;
- `prompts`: a plain prompt's text and `tokenizer(text)` ids (special tokens added: Llama's and
  Mistral's BOS).

The tokenizers are small ones of the families' shapes, trained here on the fixture's own text
(the real ones are a download away, and CI has no network):
- `llama3`: byte-level BPE, `<|begin_of_text|>` added by the post-processor, Llama-3-Instruct's
  template (which writes `bos_token` itself: the double-BOS trap);
- `qwen2.5`: the tiny-qwen2 checkpoint's byte-level BPE (`<|im_start|>`, `<|im_end|>`),
  Qwen2.5-Instruct's template (the branch without tools);
- `mistral`: SentencePiece-style BPE (Metaspace, byte fallback), `<s>` added by the
  post-processor, Mistral-7B-Instruct-v0.2's template (`[INST]` as plain text).

Run with transformers and tokenizers installed (transformers 5.25.0, tokenizers 0.23.3 made the
committed files):  python make.py
"""
import json
import os
import shutil

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- for message in messages %}{%- if (message.role == \"user\") or "
    "(message.role == \"system\" and not loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

Q = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?"
A = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
CHATS = [
    ([{"role": "user", "content": Q}], True),
    ([{"role": "user", "content": "  Spaces around, and a tab\there.  "}], True),
    ([{"role": "user", "content": "Ünïcödé: café, 数学, emoji 🙂 — done."}], True),
    ([{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "#### 4"},
      {"role": "user", "content": "And 3+3?\nShow the steps."}], True),
    ([{"role": "user", "content": Q}, {"role": "assistant", "content": A}], False),
]
SYSTEM = [{"role": "system", "content": "You are a careful math tutor."}, {"role": "user", "content": Q}]
ANSWERS = [A, " 72", "The answer is 4.\n#### 4", "数学 🙂"]
PROMPTS = [Q, "37+45=", " leading space"]
CORPUS = [Q, A, "Spaces around, and a tab here. Unicode café emoji done.", "What is 2+2? And 3+3? Show the steps.",
          "You are a careful math tutor. The answer is 4."] * 20


def trained(special, metaspace):
    if metaspace:
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        alphabet = [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=600, max_token_length=6, special_tokens=special + alphabet, show_progress=False)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=600, max_token_length=6, special_tokens=special, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write(name, tok, bos, eos, template, chats):
    out = os.path.join(HERE, name)
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "chat_template": template}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1, ensure_ascii=False)
    hf = PreTrainedTokenizerFast.from_pretrained(out)
    cases = {"chats": [], "answers": [], "prompts": []}
    for messages, gen in chats:
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        cases["chats"].append({"messages": messages, "add_generation_prompt": gen, "text": text, "ids": ids})
    for a in ANSWERS:
        cases["answers"].append({"text": a, "ids": hf(a, add_special_tokens=False)["input_ids"]})
    for p in PROMPTS:
        cases["prompts"].append({"text": p, "ids": hf(p)["input_ids"]})
    with open(os.path.join(out, "cases.json"), "w") as f:
        # One case a line.
        f.write("{\n" + ",\n".join(
            f'"{k}": [\n' + ",\n".join(json.dumps(c, ensure_ascii=False) for c in v) + "\n]"
            for k, v in cases.items()) + "\n}\n")


llama = trained(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                metaspace=False)
llama.post_processor = processors.TemplateProcessing(
    single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
    special_tokens=[("<|begin_of_text|>", llama.token_to_id("<|begin_of_text|>"))])
write("llama3", llama, "<|begin_of_text|>", "<|eot_id|>", LLAMA3, CHATS + [(SYSTEM, True)])

qwen = Tokenizer.from_file(os.path.join(HERE, "../tiny-qwen2/checkpoint/tokenizer.json"))
write("qwen2.5", qwen, None, "<|im_end|>", QWEN25, CHATS + [(SYSTEM, True)])

mistral = trained(["<unk>", "<s>", "</s>"], metaspace=True)
mistral.post_processor = processors.TemplateProcessing(
    single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", mistral.token_to_id("<s>"))])
write("mistral", mistral, "<s>", "</s>", MISTRAL, CHATS)
