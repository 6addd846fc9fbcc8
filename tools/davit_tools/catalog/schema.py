"""The evidence file of one release (`evidence/vllm-VERSION.json`): its schema.

Every section names the file inside the artifact it was read from (`source`) and says
`verified: true` when it was read from the artifact itself (the wheel, or for `torchWheel` the
pinned torch wheel's METADATA). The tool writes these models and the test suite validates the
committed files against them. Field names are camelCase in the file, like the catalog.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

SCHEMA_VERSION = 2
Sha256 = Field(pattern=r"^[a-f0-9]{64}$")


class _Data(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class Artifact(_Data):
    """The wheel every fact below was read from."""

    filename: str
    sha256: str = Sha256
    size_bytes: int = Field(ge=1)
    metadata_version: str
    commit: str | None
    requires_python: str | None
    wheel_tags: list[str]
    source: str
    verified: Literal[True]


class RunnerClass(_Data):
    kind: Literal["v1", "v2", "standalone"]
    device: Literal["gpu", "cpu", "xpu", "tpu"]
    class_name: str
    source: str
    line: int
    lineage: list[str]


class Runners(_Data):
    """Runner classes under vllm/v1/worker/; hasV1/hasV2: a GPU runner of that kind ships."""

    shipped: list[RunnerClass]
    has_v1: bool
    has_v2: bool
    source: str
    verified: Literal[True]


class Message(_Data):
    source: str
    line: int
    text: str


class Switch(_Data):
    """The runner variable: declared in vllm/envs.py (how it is parsed, its default), the
    functions that read it, and messages of code that raises naming it."""

    name: str
    declared: bool
    parse: str | None
    default: str | None
    readers: list[str]
    messages: list[Message]
    source: str
    verified: Literal[True]


class Step(_Data):
    condition: str
    outcome: str
    line: int
    where: dict[str, str]


class Validation(_Data):
    method: str
    call: str
    condition: str
    line: int


class Selection(_Data):
    """The release's runner decision (`use_v2_model_runner`; null when it has none) and where
    its runner validations run."""

    method: str | None
    steps: list[Step]
    validations: list[Validation]
    source: str
    verified: Literal[True]


class Consumer(_Data):
    """A step acting on the list: on a non-empty list, or (`whenEmpty`) on an empty one."""

    method: str
    condition: str
    outcome: str
    line: int
    when_empty: bool


class Feature(_Data):
    """One feature text and the condition that reports it. `catalogFeature` is the tool's
    reading of the text as an operator catalog feature (not a fact from the artifact)."""

    text: str
    condition: str
    line: int
    method: str
    catalog_feature: str | None


ListRole = Literal[
    "v2Unsupported",
    "v1Unsupported",
    "dboUnsupported",
    "runnerUnsupported",
    "standaloneCpuUnsupported",
    "other",
]


class FeatureList(_Data):
    method: str
    role: ListRole
    line: int
    extended_by: list[str]
    consumers: list[Consumer]
    items: list[Feature]
    source: str
    verified: Literal[True]


class Guard(_Data):
    """A raise anywhere in the package under a condition on `use_v2_model_runner`."""

    needs: Literal["v1", "v2"]
    source: str
    method: str
    line: int
    condition: str
    message: str
    verified: Literal[True]


class RunnerReads(_Data):
    """Per operator catalog feature and runner kind (v1, v2), where that runner's code reads
    the feature's config attributes (`file:line`, at most five). A reading aid: code that reads
    a setting, not proof that the runner supports it."""

    reads: dict[str, dict[Literal["v1", "v2"], list[str]]]
    source: str
    verified: Literal[True]


class Predicate(_Data):
    """A platform method a consumer condition calls, with what each platform returns."""

    source: str
    method: str
    line: int
    condition: str
    returns: str
    verified: Literal[True]


Effect = Literal[
    "selectsV1OnAuto",
    "refusedOnV2",
    "refusedOnV1",
    "refused",
    "refusedOnStandaloneCpu",
    "forcesV2",
]


class Summary(_Data):
    """Derived from the sections above by the tool: feature texts by what the release does with
    them (`selectsV1OnAuto`: runner V1 when the switch is unset; `refusedOnV2` / `refusedOnV1`:
    the runner's validation raises; `refused`: the only runner's validation raises;
    `refusedOnStandaloneCpu`: raised when the standalone CPU runner is in use; `forcesV2`: a
    decision step returning V2, or a guard needing V2)."""

    effects: dict[Effect, list[str]]


class Flag(_Data):
    exists: bool
    how: Literal["add_argument", "field", "negation"] | None
    source: str | None
    line: int | None
    note: str


class Flags(_Data):
    """Each flag the operator's command lines use, looked up in the release's source."""

    flags: dict[str, Flag]
    source: str
    verified: Literal[True]


class SpeculativeMethods(_Data):
    """The release's `SpeculativeMethod` literal and, per method of the operator's API,
    whether the release names it."""

    known: list[str]
    operator: dict[str, bool]
    source: str
    verified: Literal[True]


class PrecisionValues(_Data):
    """A Literal the release types one engine argument with, and per value of the operator's
    field whether the release names it."""

    known: list[str]
    operator: dict[str, bool]
    source: str


class Precision(_Data):
    """`--quantization` (`QuantizationMethods`) and `--kv-cache-dtype` (`CacheDType`)."""

    quantization: PrecisionValues
    kv_cache_dtypes: PrecisionValues
    verified: Literal[True]


class PassConfigField(_Data):
    name: str
    annotation: str
    line: int
    doc: str


class PassConfig(_Data):
    """The compilation pass config's fields (`--compilation-config '{"pass_config": ...}'`), each
    with the first sentence of its docstring; `sequenceParallelismKey` is the bool field whose
    docstring begins with "Enable sequence parallelism" (the tool's reading), null when none."""

    class_name: str
    line: int
    fields: list[PassConfigField]
    sequence_parallelism_key: str | None
    source: str
    verified: Literal[True]


class NativeLibrary(_Data):
    member: str
    cudart_major: int | None
    nvcc_releases: list[str]


class Cuda(_Data):
    """CUDA of the default build: `version` is the nvcc release the native code was built
    with, `cudartMajor` the CUDA runtime it loads."""

    version: str | None
    cudart_major: int | None
    libraries: list[NativeLibrary]
    cuda_tagged_requirements: list[str]
    source: str
    verified: Literal[True]


class Pins(_Data):
    torch: str | None
    torchvision: str | None
    torchaudio: str | None
    triton: str | None
    source: str
    verified: Literal[True]


class TorchWheel(_Data):
    """The torch wheel the pin resolves to (manylinux x86_64) and its METADATA requirements."""

    filename: str
    sha256: str = Sha256
    cuda_toolkit: str | None
    triton: str | None
    requires: list[str]
    source: str
    verified: Literal[True]


class Build(_Data):
    cuda: Cuda
    pins: Pins
    torch_wheel: TorchWheel | None


class StaticCheck(_Data):
    """The line's flags and JSON keys looked up in the release's source."""

    unknown_flags: list[str]
    unknown_json_keys: list[str]


class CommandLineResult(_Data):
    """One command line and what the release's own CLI made of it: the operator's (`example:`,
    `feature:`; `args` empty where the operator's argument builder itself refuses the spec for
    this release) or a probe of the release (`switch:`, `probe:`). An empty line is not parsed
    (`parsed: null`)."""

    name: str
    origin: str
    command: list[str]
    args: list[str]
    env: dict[str, str]
    planner: str
    static_check: StaticCheck
    parsed: bool | None
    error: str | None
    values: dict[str, object]
    engine_args: str | None
    environ: str | None


class Contract(_Data):
    """The contract check: `checked` false when it was not run for this release (then every
    line has `parsed: null`)."""

    checked: bool
    method: str
    limits: str
    python: str | None
    install_steps: list[str]
    installed: list[str]
    command_lines: list[CommandLineResult]
    verified: bool


class Evidence(_Data):
    schema_version: Literal[2]
    engine: Literal["vllm"]
    version: str = Field(pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$")
    published: bool
    tool: str
    artifact: Artifact | None
    runners: Runners | None
    switch: Switch | None
    selection: Selection | None
    feature_lists: list[FeatureList]
    guards: list[Guard]
    runner_reads: RunnerReads | None
    platform_predicates: list[Predicate]
    summary: Summary | None
    flags: Flags | None
    speculative_methods: SpeculativeMethods | None
    precision: Precision | None
    pass_config: PassConfig | None
    build: Build | None
    contract: Contract | None
