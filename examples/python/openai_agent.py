#!/usr/bin/env python3
"""An agent program for Trellis's agent gateway (docs/agents.md): an ordinary `openai` client
loop with a calculator tool, as it would run against any OpenAI-compatible server. Trellis
starts it once per episode with OPENAI_BASE_URL pointing at the episode's session, gives it the
problem as one JSON line on standard input, and takes the last line it prints as its reward.

Use it from a workflow (the model's chat template renders the calls):

    data: {task: arith, digits: 2, chat_template: true,
           env: {type: agent, command: [python3, examples/python/openai_agent.py]}}

What it does: asks the model; runs the tool calls it makes and sends their results back; if the
model answers without a tool the first time, it starts over once with a hint (a rewritten
history: Trellis records that as a second trajectory of the episode); an answer without a number
is asked again; finally it scores the last number the model said against the answer. `--stream`
makes every call a streamed one; `--transcript DIR` writes the conversation (`tools`,
`messages`) to DIR/SESSION.json.
"""

import argparse
import json
import os
import re
import sys

from openai import OpenAI

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression of whole numbers: + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12*34"}},
            "required": ["expression"],
        },
    },
}]

HINT = " Use the calculator tool."


def calculator(expression):
    if not re.fullmatch(r"[0-9+\-*/() ]{1,64}", expression or ""):
        return "error: not an arithmetic expression"
    try:
        return str(eval(expression, {"__builtins__": {}}))
    except Exception as e:  # a malformed expression is the model's mistake, told to it
        return f"error: {e}"


def ask(client, messages, stream):
    """One call: the assistant's message as a dict (content, tool_calls)."""
    if not stream:
        r = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        m = r.choices[0].message
        calls = [{"id": c.id, "type": "function",
                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for c in (m.tool_calls or [])]
        return {"role": "assistant", "content": m.content, "tool_calls": calls}
    content, calls = "", {}
    for chunk in client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for c in d.tool_calls or []:
            call = calls.setdefault(c.index, {"id": c.id, "type": "function",
                                              "function": {"name": "", "arguments": ""}})
            call["function"]["name"] += c.function.name or ""
            call["function"]["arguments"] += c.function.arguments or ""
    return {"role": "assistant", "content": content or None,
            "tool_calls": [calls[k] for k in sorted(calls)]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stream", action="store_true")
    p.add_argument("--transcript")
    p.add_argument("--turns", type=int, default=4)
    args = p.parse_args()
    problem = json.loads(sys.stdin.readline())
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from Trellis
    system = {"role": "system", "content": "Answer with a number."}
    messages = [system, {"role": "user", "content": problem["prompt"]}]
    first = True
    said = ""
    for _ in range(args.turns):
        reply = ask(client, messages, args.stream)
        if not reply["tool_calls"]:
            del reply["tool_calls"]
        messages.append(reply)
        said = reply.get("content") or ""
        was_first, first = first, False
        if reply.get("tool_calls"):
            for c in reply["tool_calls"]:
                try:
                    expression = json.loads(c["function"]["arguments"]).get("expression")
                except (ValueError, AttributeError):
                    expression = None
                messages.append({"role": "tool", "tool_call_id": c["id"],
                                 "content": calculator(expression)})
        elif was_first:
            # Answered at once, without the tool: start over with a hint (the history is
            # rewritten).
            messages = [system, {"role": "user", "content": problem["prompt"] + HINT}]
        elif not re.search(r"\d", said):
            messages.append({"role": "user", "content": "Answer with just the number."})
        else:
            break
    if args.transcript:
        with open(os.path.join(args.transcript, os.environ["TRELLIS_SESSION"] + ".json"), "w") as f:
            json.dump({"tools": TOOLS, "messages": messages}, f)
    numbers = re.findall(r"-?\d+", said)
    print(1.0 if numbers and numbers[-1] == problem["answer"].strip() else 0.0)


if __name__ == "__main__":
    main()
