"""What a release does with each feature, derived from the facts read from its source.

A feature list's consumers say what happens when the list is not empty: the decision property
returning False (runner V1 when the switch is unset), or a validation raising; where that
validation runs (`selection.validations`) says for which runner. A feature reported only while
the switch is set never selects V1 on auto; one reported only while it is unset never reaches
V2's validation (auto then selects V1). Decision steps returning True, and guards that need V2,
force V2.
"""

from __future__ import annotations

import re
from typing import Any

STANDALONE_CPU = "current_platform.uses_standalone_cpu_model_runner()"
SWITCH = "VLLM_USE_V2_MODEL_RUNNER"
SWITCH_SET = f"not (envs.{SWITCH} is None)"
SWITCH_UNSET = re.compile(rf"(?<!not \()envs\.{SWITCH} is None")
ROLES = (
    ("v2_model_runner", "v2Unsupported"),
    ("v1_model_runner", "v1Unsupported"),
    ("dbo", "dboUnsupported"),
    ("standalone_cpu", "standaloneCpuUnsupported"),
    ("_get_model_runner_", "runnerUnsupported"),
)


def list_role(method: str) -> str:
    """The role of a `_get_*unsupported_features` method, by its name."""
    name = method.rsplit(".", 1)[-1]
    return next((role for marker, role in ROLES if marker in name), "other")


def _effect(consumer: dict[str, Any], selection: dict[str, Any]) -> str | None:
    if consumer["method"] == selection["method"]:
        return "selectsV1OnAuto" if consumer["outcome"] == "returns False" else None
    if consumer["outcome"] != "raises":
        return None
    if STANDALONE_CPU in consumer["condition"]:
        return "refusedOnStandaloneCpu"
    call = consumer["method"].rsplit(".", 1)[-1]
    conditions = {v["condition"] for v in selection["validations"] if v["call"] == call}
    if conditions == {"self.use_v2_model_runner"}:
        return "refusedOnV2"
    if conditions == {"not (self.use_v2_model_runner)"}:
        return "refusedOnV1"
    return "refused"


def summarize(
    selection: dict[str, Any], lists: list[dict[str, Any]], guards: list[dict[str, Any]]
) -> dict[str, Any]:
    effects: dict[str, list[str]] = {}

    def add(effect: str, text: str) -> None:
        texts = effects.setdefault(effect, [])
        if text not in texts:
            texts.append(text)

    acting: set[int] = set()  # decision lines whose effect the list items already state
    for feature_list in lists:
        for consumer in feature_list["consumers"]:
            effect = _effect(consumer, selection)
            if effect is None or consumer["whenEmpty"]:
                continue
            if consumer["method"] == selection["method"]:
                acting.add(consumer["line"])
            for item in feature_list["items"]:
                if effect == "selectsV1OnAuto" and SWITCH_SET in item["condition"]:
                    continue  # reported only when the switch is set, never on auto
                if effect == "refusedOnV2" and SWITCH_UNSET.search(item["condition"]):
                    continue  # reported only on auto, which then selects V1, never validates V2
                add(effect, item["text"])
    for step in selection["steps"]:
        if step["line"] in acting or SWITCH in str(step["where"]):
            continue
        if step["outcome"] == "returns False":
            add("selectsV1OnAuto", f"when {step['condition']}")
        elif step["outcome"] == "returns True" and step["condition"] != "always":
            add("forcesV2", f"when {step['condition']}")
    for guard in guards:
        if guard["needs"] == "v2":
            add("forcesV2", guard["message"])
    return {"effects": effects}
