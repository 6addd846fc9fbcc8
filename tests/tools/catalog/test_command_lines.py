"""The operator still writes the command lines the committed evidence recorded.

The evidence's contract section holds, per release, the operator's vLLM command lines as the
catalog tool planned them and what the release's own CLI made of them. When the operator's
argument builder, the planner's choice of runner variable or an example changes, the lines
planned today differ from the recorded ones and this test fails until the tool is run again
(`python -m davit_tools.catalog.evidence VERSION...`, see tools/davit_tools/catalog/README.md),
so no changed line goes unchecked by the releases' parsers. No wheel, no network.
"""

from __future__ import annotations

import json

import pytest

from davit_tools.catalog.command_lines import operator_command_lines
from davit_tools.catalog.evidence import EVIDENCE_DIR
from davit_tools.catalog.schema import Evidence
from tests.tools.catalog.test_evidence_files import RELEASES


@pytest.mark.parametrize("version", RELEASES)
def test_the_operator_writes_the_recorded_lines(version: str) -> None:
    evidence = Evidence.model_validate(
        json.loads((EVIDENCE_DIR / f"vllm-{version}.json").read_text())
    )
    assert evidence.contract is not None
    recorded = {
        line.name: (line.command, line.args, line.env) for line in evidence.contract.command_lines
    }
    planned = {
        line.name: (line.command, line.args, line.env) for line in operator_command_lines(version)
    }
    changed = sorted(
        name for name in recorded.keys() | planned.keys() if recorded.get(name) != planned.get(name)
    )
    assert not changed, (
        f"the operator's command lines for vllm {version} changed ({', '.join(changed)}): run "
        f"python -m davit_tools.catalog.evidence {version} and commit the evidence file"
    )
