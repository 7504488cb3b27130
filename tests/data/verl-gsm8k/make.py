"""VeRL's GSM8K preprocessing (examples/data_preprocess/gsm8k.py) on a few GSM8K-style rows:
the same columns, nesting and text as `python examples/data_preprocess/gsm8k.py` writes, so the
end-to-end test trains on VeRL's own layout.

- `data_source`: "openai/gsm8k"
- `prompt`: [{"role": "user", "content": question + " " + instruction}] (a chat)
- `ability`: "math"
- `reward_model`: {"style": "rule", "ground_truth": the number after "#### "}
- `extra_info`: {"split", "index", "answer", "question"}

VeRL writes with `datasets.Dataset.to_parquet` (pyarrow, snappy); this writes the same rows with
pyarrow directly, so it needs only pyarrow (26.0.1 made the committed files):
    python make.py
"""
import re

import pyarrow as pa
import pyarrow.parquet as pq

data_source = "openai/gsm8k"
instruction_following = 'Let\'s think step by step and output the final answer after "####".'


def extract_solution(solution_str):
    solution = re.search("#### (\\-?[0-9\\.\\,]+)", solution_str)
    assert solution is not None
    final_solution = solution.group(0)
    final_solution = final_solution.split("#### ")[1].replace(",", "")
    return final_solution


def make_map_fn(split):
    def process_fn(example, idx):
        question_raw = example.pop("question")
        question = question_raw + " " + instruction_following
        answer_raw = example.pop("answer")
        solution = extract_solution(answer_raw)
        return {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {
                "split": split,
                "index": idx,
                "answer": answer_raw,
                "question": question_raw,
            },
        }

    return process_fn


def gsm8k_rows(n, offset):
    """GSM8K-style problems (the real dataset is not fetched: no network in CI)."""
    names = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis"]
    rows = []
    for i in range(offset, offset + n):
        who = names[i % len(names)]
        a, b, price = 3 + i % 9, 2 + (5 * i) % 7, 1 + i % 4
        total = (a + b) * price
        rows.append({
            "question": f"{who} buys {a} pens on Monday and {b} pens on Tuesday. "
                        f"Each pen costs ${price}. How much does {who} spend?",
            "answer": f"{who} buys {a} + {b} = <<{a}+{b}={a + b}>>{a + b} pens.\n"
                      f"They cost {a + b} * {price} = <<{a + b}*{price}={total}>>{total} dollars.\n"
                      f"#### {total:,}",
        })
    return rows


for split, n, offset in [("train", 24, 0), ("test", 8, 100)]:
    fn = make_map_fn(split)
    rows = [fn(dict(r), idx) for idx, r in enumerate(gsm8k_rows(n, offset))]
    pq.write_table(pa.Table.from_pylist(rows), f"{split}.parquet")
