"""Tool-use chat fixtures: what transformers' `apply_chat_template(messages, tools=...)` renders
with Qwen2.5-Instruct's chat template as shipped (`qwen2.5-tools.jinja`: the branch with tools
too), so the Rust chat template can be checked character for character on the tools' JSON
(`tojson`), assistant tool calls and tool results.

Writes `qwen2.5/tools.json`: a list of {"messages", "tools", "add_generation_prompt", "text"}.
Run with transformers installed (transformers 5.25.0 and jinja2 3.1.6 made the committed file):
python make_tools.py
"""
import json
import os

from transformers import PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression: + - * / and parentheses (a < b & c > d is not one).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12*34"}},
            "required": ["expression"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Finds pages about a topic — in any language: «Zürich», 東京.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "default": 3, "minimum": 1},
            },
            "required": ["query"],
        },
    },
}

CASES = [
    ([{"role": "user", "content": "What is 12*34?"}], [CALCULATOR], True),
    (
        [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "What is 12*34?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "408"},
        ],
        [CALCULATOR, SEARCH],
        True,
    ),
    (
        [
            {"role": "user", "content": "Find Zürich, then add 2+3."},
            {
                "role": "assistant",
                "content": "Two calls.",
                "tool_calls": [
                    {"type": "function",
                     "function": {"name": "search", "arguments": {"query": "Zürich", "limit": 2}}},
                    {"type": "function",
                     "function": {"name": "calculator", "arguments": {"expression": "2+3"}}},
                ],
            },
            {"role": "tool", "content": "a city"},
            {"role": "tool", "content": "5"},
            {"role": "assistant", "content": "Zürich is a city; 2+3 is 5."},
        ],
        [SEARCH, CALCULATOR],
        False,
    ),
]


def main():
    with open(os.path.join(HERE, "qwen2.5-tools.jinja")) as f:
        template = f.read()
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(HERE, "qwen2.5", "tokenizer.json"))
    out = []
    for messages, tools, gen in CASES:
        text = tok.apply_chat_template(
            messages, tools=tools, chat_template=template, add_generation_prompt=gen, tokenize=False
        )
        out.append({"messages": messages, "tools": tools, "add_generation_prompt": gen, "text": text})
    with open(os.path.join(HERE, "qwen2.5", "tools.json"), "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
