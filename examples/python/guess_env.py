#!/usr/bin/env python3
"""A Trellis environment as a program: find the problem's answer, told `+` (higher) or `-`
(lower) after every wrong guess — the built-in `guess` environment, written as anyone can write
their own (docs/agents.md). Trellis starts it for every episode and speaks JSON lines:

    in:  {"op": "reset", "prompt": "...", "answer": "..."}   out: {"ok": true}
    in:  {"op": "step", "text": "<the model's turn>"}        out: {"observation": "+", "role": "user"}
                                                                  or {"reward": 1.0, "done": true}

Use it from a workflow:

    data: {task: arith, digits: 1, env: {type: command, name: guess,
                                         command: [python3, examples/python/guess_env.py]}}
"""

import json
import re
import sys


class GuessEnv:
    """Gym-style: reset with the problem, step with the model's turn."""

    def reset(self, prompt, answer):
        self.secret = int(answer)

    def step(self, text):
        numbers = re.findall(r"-?\d+", text)
        if not numbers:
            return None, 0.0, True  # no guess: the episode cannot go on
        guess = int(numbers[-1])
        if guess == self.secret:
            return None, 1.0, True
        return ("+" if guess < self.secret else "-"), 0.0, False


def main():
    env = GuessEnv()
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "reset":
                env.reset(msg["prompt"], msg["answer"])
                out = {"ok": True}
            else:
                observation, reward, done = env.step(msg["text"])
                out = {"observation": observation, "role": "user", "reward": reward, "done": done}
        except Exception as e:  # the episode fails, named; Trellis goes on
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
