"""A custom reward as VeRL users write one (`custom_reward_function` in VeRL's config): dispatch
on `data_source`, read `extra_info`, score GSM8K with VeRL's strict `#### N` rule. It raises when
a row's `data_source` or `extra_info` did not come through, so a run that trains with it proves
they do."""

import re

_SOLUTION_CLIP_CHARS = 300


def gsm8k_score(solution_str, ground_truth, format_score=0.0, score=1.0):
    # VeRL's verl/utils/reward_score/gsm8k.py, method="strict".
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
    if not solutions:
        return 0.0
    answer = solutions[-1].replace(",", "").replace("$", "")
    return score if answer == ground_truth else format_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source != "openai/gsm8k":
        raise NotImplementedError(f"Reward function is not implemented for {data_source=}")
    # The row's own extra_info: its GSM8K answer ends with this row's ground truth.
    if extra_info["split"] not in ("train", "test") or not isinstance(extra_info["index"], int):
        raise ValueError(f"not VeRL's extra_info: {extra_info!r}")
    if extra_info["answer"].split("#### ")[-1].replace(",", "") != ground_truth:
        raise ValueError(f"extra_info of another row: {extra_info!r} for {ground_truth!r}")
    return gsm8k_score(solution_str, ground_truth)
