"""A GSM8K reward written the way VeRL users write theirs (VeRL's `custom_reward_function`
signature, VeRL's strict `#### N` extraction), used unchanged by `reward: {type: python}` in the
end-to-end tests."""

import re

_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_solution(solution_str):
    """The number after the last `#### `, commas and dollars dropped; None without one."""
    found = _ANSWER.findall(solution_str)
    if not found:
        return None
    return found[-1].replace(",", "").replace("$", "")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # VeRL's preprocessing keeps only the final number of GSM8K's answer; accept either.
    if "####" in ground_truth:
        ground_truth = ground_truth.split("####")[-1].strip().replace(",", "")
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    return 1.0 if answer == ground_truth else 0.0
