"""`--speculative-config`: upstream's JSON keys and meanings, validated into a frozen dataclass.

Keys (upstream's names): `method`, `num_speculative_tokens` (K), `prompt_lookup_min` /
`prompt_lookup_max` (n-gram window), `model` (draft model), `rejection_sample_method`
(`standard` | `synthetic` | `block` | `fly`), `fly_window_size` (default min(6, K-1)),
`fly_entropy_threshold` (0.3), `fly_entropy_top_k` (3), `synthetic_acceptance_rates` /
`synthetic_acceptance_length`. Every refusal is a ParamError("--speculative-config") whose
message names the key.

Verification policies:
- `standard` (strict, the default): lossless. Greedy keeps the longest prefix of drafts the
  target's argmax agrees with plus one target token; sampled requests use rejection sampling,
  so the output follows the target's distribution exactly.
- `fly` (lossy, opt-in): like strict, but one rejected draft in a high-entropy position may be
  kept when the following `fly_window_size` drafts would be accepted and the target gives it a
  non-zero probability.
- `synthetic` (lossy, benchmarking only): drafts are accepted at the configured rates or
  length, whatever the target says.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from davit_engine.types import ParamError

FLAG = "--speculative-config"
# Upstream's methods; the ones this engine runs are IMPLEMENTED_METHODS.
SPECULATIVE_METHODS = (
    "ngram",
    "eagle",
    "eagle3",
    "mtp",
    "draft_model",
    "medusa",
    "mlp_speculator",
)
IMPLEMENTED_METHODS = ("ngram", "draft_model")
REJECTION_SAMPLE_METHODS = ("standard", "synthetic", "block", "fly")
IMPLEMENTED_REJECTION_SAMPLE_METHODS = ("standard", "synthetic", "fly")
MAX_SPECULATIVE_TOKENS = 16
# Without either window bound: match 3 to 5 trailing tokens (a shorter match proposes noise).
DEFAULT_PROMPT_LOOKUP_MIN = 3
DEFAULT_PROMPT_LOOKUP_MAX = 5
DEFAULT_FLY_ENTROPY_THRESHOLD = 0.3
DEFAULT_FLY_ENTROPY_TOP_K = 3

RejectionSampleMethod = Literal["standard", "synthetic", "block", "fly"]
_KEYS = {
    "method",
    "num_speculative_tokens",
    "model",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "rejection_sample_method",
    "fly_window_size",
    "fly_entropy_threshold",
    "fly_entropy_top_k",
    "synthetic_acceptance_rates",
    "synthetic_acceptance_length",
}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative-decoding configuration (see the module docstring).

    `prompt_lookup_min`/`_max` and `fly_window_size` hold the effective values once validated
    (defaults filled in); the JSON may leave them out.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    rejection_sample_method: RejectionSampleMethod = "standard"
    fly_window_size: int | None = None
    fly_entropy_threshold: float = DEFAULT_FLY_ENTROPY_THRESHOLD
    fly_entropy_top_k: int = DEFAULT_FLY_ENTROPY_TOP_K
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    synthetic_acceptance_length: float | None = None

    @property
    def is_lossy(self) -> bool:
        """Whether verification may emit tokens the target would not (FLy, synthetic)."""
        return self.rejection_sample_method in ("fly", "synthetic")

    @property
    def verification(self) -> str:
        """The policy's label in logs, metrics, engine info and benchmark lines."""
        return {"standard": "strict", "fly": "fly", "synthetic": "synthetic"}.get(
            self.rejection_sample_method, self.rejection_sample_method
        )

    def describe(self) -> str:
        """One line for the startup log and benchmark lines."""
        words = [f"method {self.method}", f"K={self.num_speculative_tokens}"]
        if self.method == "ngram":
            words.append(f"n-gram {self.prompt_lookup_min}-{self.prompt_lookup_max}")
        if self.model:
            words.append(f"draft {self.model}")
        words.append(f"verification {self.verification}")
        if self.rejection_sample_method == "fly":
            words.append(
                f"(LOSSY: window {self.fly_window_size}, entropy > "
                f"{self.fly_entropy_threshold:g} over top-{self.fly_entropy_top_k})"
            )
        elif self.rejection_sample_method == "synthetic":
            words.append(
                f"(LOSSY, benchmarking only: rates {self.synthetic_acceptance_rates}, "
                f"length {self.synthetic_acceptance_length})"
            )
        return ", ".join(words)

    def to_info(self) -> dict[str, Any]:
        """Plain data for the engine info and /v1/models."""
        return {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "model": self.model,
            "prompt_lookup_min": self.prompt_lookup_min,
            "prompt_lookup_max": self.prompt_lookup_max,
            "rejection_sample_method": self.rejection_sample_method,
            "verification": self.verification,
            "lossy": self.is_lossy,
            "fly_window_size": self.fly_window_size,
            "fly_entropy_threshold": self.fly_entropy_threshold,
            "fly_entropy_top_k": self.fly_entropy_top_k,
        }

    def validate(self) -> None:
        """Raise ParamError(FLAG) naming the first invalid key; also refuses what this engine
        does not implement (methods, `block` verification), naming it."""
        method, k = self.method, self.num_speculative_tokens
        if method not in SPECULATIVE_METHODS:
            raise ParamError(
                FLAG, f"method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}"
            )
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ParamError(
                FLAG,
                f"num_speculative_tokens must be an integer 1-{MAX_SPECULATIVE_TOKENS}, got {k!r}",
            )
        if self.model is not None and not isinstance(self.model, str):
            raise ParamError(FLAG, f"model must be a string, got {self.model!r}")
        if method == "draft_model" and not self.model:
            raise ParamError(FLAG, "method draft_model needs model (the draft model's source)")
        if self.model is not None and method == "ngram":
            raise ParamError(FLAG, "model does not apply to method ngram (it drafts from text)")
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, key)
            if value is None:
                continue
            if not _is_int(value) or value < 1:
                raise ParamError(FLAG, f"{key} must be a positive integer, got {value!r}")
            if method != "ngram":
                raise ParamError(FLAG, f"{key} only applies to method ngram")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is not None and high is not None and low > high:
            raise ParamError(FLAG, f"prompt_lookup_min {low} exceeds prompt_lookup_max {high}")
        rsm = self.rejection_sample_method
        if rsm not in REJECTION_SAMPLE_METHODS:
            raise ParamError(
                FLAG,
                f"rejection_sample_method must be one of {', '.join(REJECTION_SAMPLE_METHODS)}, "
                f"got {rsm!r}",
            )
        self._validate_fly()
        self._validate_synthetic()
        if method not in IMPLEMENTED_METHODS:
            raise ParamError(
                FLAG,
                f"method {method} is not implemented by this engine version (it runs "
                f"{' and '.join(IMPLEMENTED_METHODS)}); use one of those, or serve with engine "
                "type vllm",
            )
        if rsm not in IMPLEMENTED_REJECTION_SAMPLE_METHODS:
            raise ParamError(
                FLAG,
                f"rejection_sample_method {rsm} is not implemented by this engine version (it "
                f"runs {', '.join(IMPLEMENTED_REJECTION_SAMPLE_METHODS)})",
            )

    def _validate_fly(self) -> None:
        k = self.num_speculative_tokens
        is_fly = self.rejection_sample_method == "fly"
        if is_fly and k < 2:
            raise ParamError(
                FLAG,
                f"rejection_sample_method fly needs num_speculative_tokens >= 2 (a rejected "
                f"draft is kept only when later drafts confirm it), got {k}",
            )
        window = self.fly_window_size
        if window is not None:
            if not is_fly:
                raise ParamError(
                    FLAG, "fly_window_size only applies to rejection_sample_method fly"
                )
            if not _is_int(window) or not 1 <= window <= k - 1:
                raise ParamError(
                    FLAG,
                    f"fly_window_size must be an integer 1-{k - 1} (num_speculative_tokens - 1), "
                    f"got {window!r}",
                )
        threshold = self.fly_entropy_threshold
        if not _is_number(threshold) or threshold < 0:
            raise ParamError(
                FLAG, f"fly_entropy_threshold must be a number >= 0, got {threshold!r}"
            )
        top_k = self.fly_entropy_top_k
        if not _is_int(top_k) or top_k < 2:
            raise ParamError(FLAG, f"fly_entropy_top_k must be an integer >= 2, got {top_k!r}")

    def _validate_synthetic(self) -> None:
        k = self.num_speculative_tokens
        rates, length = self.synthetic_acceptance_rates, self.synthetic_acceptance_length
        is_synthetic = self.rejection_sample_method == "synthetic"
        for key, value in (
            ("synthetic_acceptance_rates", rates),
            ("synthetic_acceptance_length", length),
        ):
            if value is not None and not is_synthetic:
                raise ParamError(FLAG, f"{key} only applies to rejection_sample_method synthetic")
        if not is_synthetic:
            return
        if (rates is None) == (length is None):
            raise ParamError(
                FLAG,
                "rejection_sample_method synthetic needs exactly one of "
                "synthetic_acceptance_rates and synthetic_acceptance_length",
            )
        if rates is not None and (
            len(rates) != k or not all(_is_number(r) and 0.0 <= r <= 1.0 for r in rates)
        ):
            raise ParamError(
                FLAG,
                f"synthetic_acceptance_rates must be {k} numbers in [0, 1] (one per draft "
                f"position), got {list(rates)!r}",
            )
        if length is not None and (not _is_number(length) or not 1.0 <= length <= k + 1):
            raise ParamError(
                FLAG,
                f"synthetic_acceptance_length must be a number in [1, {k + 1}] (tokens per "
                f"verification step, the bonus token included), got {length!r}",
            )


def speculative_config_from_json(raw: dict[str, Any]) -> SpeculativeConfig:
    """Build and validate from upstream's JSON object (defaults filled in)."""
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ParamError(
            FLAG, f"unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_KEYS))})"
        )
    rates = raw.get("synthetic_acceptance_rates")
    if rates is not None and not isinstance(rates, list):
        raise ParamError(FLAG, f"synthetic_acceptance_rates must be a list, got {rates!r}")
    method = raw.get("method")
    low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    config = SpeculativeConfig(
        method=method,  # type: ignore[arg-type]  # validated below
        num_speculative_tokens=raw.get("num_speculative_tokens"),  # type: ignore[arg-type]
        model=raw.get("model"),
        prompt_lookup_max=high,
        prompt_lookup_min=low,
        rejection_sample_method=raw.get("rejection_sample_method", "standard"),
        fly_window_size=raw.get("fly_window_size"),
        fly_entropy_threshold=raw.get("fly_entropy_threshold", DEFAULT_FLY_ENTROPY_THRESHOLD),
        fly_entropy_top_k=raw.get("fly_entropy_top_k", DEFAULT_FLY_ENTROPY_TOP_K),
        synthetic_acceptance_rates=tuple(rates) if rates is not None else None,
        synthetic_acceptance_length=raw.get("synthetic_acceptance_length"),
    )
    config.validate()
    return with_defaults(config)


def with_defaults(config: SpeculativeConfig) -> SpeculativeConfig:
    """The effective values of the optional keys (n-gram window, FLy window)."""
    low, high = config.prompt_lookup_min, config.prompt_lookup_max
    if config.method == "ngram":
        if low is None and high is None:
            low, high = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
        elif low is None:
            low = min(DEFAULT_PROMPT_LOOKUP_MIN, high)  # type: ignore[type-var]
        elif high is None:
            high = max(DEFAULT_PROMPT_LOOKUP_MAX, low)
    window = config.fly_window_size
    if config.rejection_sample_method == "fly" and window is None:
        window = min(6, config.num_speculative_tokens - 1)
    return dataclasses.replace(
        config, prompt_lookup_min=low, prompt_lookup_max=high, fly_window_size=window
    )


def max_speculating_seqs(max_num_seqs: int, max_num_batched_tokens: int, k: int) -> int:
    """How many requests may verify drafts in one step: each takes K + 1 target tokens of the
    batch budget, so no more than budget // (K + 1) fit; the runner sizes its verification and
    draft buffers (and graphs) for this many rows."""
    return max(1, min(max_num_seqs, max_num_batched_tokens // (k + 1)))
